"""``with`` support for the objects that own a duplicated MPI communicator."""


class ClosesOnExit:
    """``with obj: ...`` calls ``obj.close()`` on exit, also on errors, so the duplicated
    communicator is freed; subclasses define an idempotent ``close()``."""

    def close(self):
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
