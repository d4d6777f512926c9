"""The one error type of the text-data pipeline; its message names the bad file, line or key."""


class DataError(ValueError):
    """A tokenizer, input file or dataset prefix that cannot be used as given."""
