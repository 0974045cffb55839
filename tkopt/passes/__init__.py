"""Canonicalization, recognition and fusion rules over tkopt's IR."""
