"""A handler module that fails to import, as one with a missing dependency would."""

raise ImportError("simulated: a dependency of this handler module is not installed")
