"""Test and operations tooling (process trees, the chaos runner), not part of the library."""
