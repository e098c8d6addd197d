"""The package version, in one place (read by the package, the CLI and build manifests)."""

__version__ = "0.1.0"
