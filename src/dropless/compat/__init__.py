"""Compatibility at the config edge: other frameworks' flag names translated to ours."""
