"""Example deltastore hooks to copy and adapt (not shipped with the package)."""
