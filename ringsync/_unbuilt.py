"""What stands in for the native parts of ringsync where the core was not built (the
launcher and `ringsync doctor` still work there)."""


def unbuilt(error: ImportError):
    """A callable that raises, naming the missing build step."""
    def not_built(*args, **kwargs):
        raise ImportError(
            "ringsync's native core (ringsync._native) is not built; install the package with "
            "`pip install .` (or `pip install -e .`) so that cffi compiles native/"
        ) from error
    return not_built
