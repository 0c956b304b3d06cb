"""Texts shipped with the package (public domain)."""
