"""The one error type of the text-data pipeline; its message names the bad file, line or key."""

from loongforge.core.errors import DataError as CoreDataError


class DataError(CoreDataError):
    """A tokenizer, input file or dataset prefix that cannot be used as given."""
