"""The one exception type the exchange engine raises for bad or inconsistent input."""


class ExchangeError(ValueError):
    """Raised on EVERY rank when one rank's input is invalid or the ranks disagree.

    The check behind it is collective (see :mod:`.validation`), so every rank
    raises the same error with the same message instead of one rank failing
    alone and the others hanging in the next collective.
    """
