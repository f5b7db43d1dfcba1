"""The one error every way a GGUF file can lie ends in (gguf_file.py, gguf_metadata.py and the
readers of its values raise it); its own module so the file and its metadata need not import
each other."""


class BadGGUF(ValueError):
    """A GGUF file that cannot be read as one, or whose metadata lies; its reader prefixes the path."""
