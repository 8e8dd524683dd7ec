"""kdtr's version, one place: the package metadata, the bundles' generator field and --version."""

__version__ = "0.1.0"
