"""Byte and message counters of one rank's share of an exchange."""
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Traffic:
    """What this rank sent and received, counted by :class:`.comm.CountingComm`.

    All fields are plain ints.  ``bytes_*`` include everything; ``control_bytes_*``
    are the part of them that is metadata (validation header, counts, threshold
    search), so ``payload_bytes_*`` is what carried (index, value) data.
    Traffics add and subtract field by field, e.g. ``after - before`` is one call.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    control_bytes_sent: int = 0
    control_bytes_received: int = 0

    def _combine(self, other, sign):
        if not isinstance(other, Traffic):
            return NotImplemented
        return Traffic(**{f.name: getattr(self, f.name) + sign * getattr(other, f.name)
                          for f in fields(self)})

    def __add__(self, other):
        return self._combine(other, +1)

    def __sub__(self, other):
        return self._combine(other, -1)

    @property
    def payload_bytes_sent(self) -> int:
        """Bytes sent that carried indices or values."""
        return self.bytes_sent - self.control_bytes_sent

    @property
    def payload_bytes_received(self) -> int:
        """Bytes received that carried indices or values."""
        return self.bytes_received - self.control_bytes_received

    @property
    def total_bytes(self) -> int:
        """bytes_sent + bytes_received."""
        return self.bytes_sent + self.bytes_received

    @property
    def payload_bytes(self) -> int:
        """payload_bytes_sent + payload_bytes_received."""
        return self.payload_bytes_sent + self.payload_bytes_received
