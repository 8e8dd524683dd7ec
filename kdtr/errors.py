"""The error every layer raises for bad user input: the CLI prints it as one line, exit code 2."""


class InputError(ValueError):
    """Bad user input (no bundles found, unknown suite...): one line, exit code 2."""


class KernelSpecError(ValueError):
    """A kernel spec that names nothing runnable (one-line message)."""
