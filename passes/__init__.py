"""Canonicalization, recognition and fusion rules over tkopt's IR (installed as tkopt.passes)."""

if __name__ != "tkopt.passes":  # imported by its folder's name, from a checkout's root on sys.path
    raise ImportError(f"{__file__} (tkopt.passes) was imported as `{__name__}`: Python started in a tkopt checkout's "
                      f"root, whose passes/ folder hides any installed `{__name__}` package. Run Python from another "
                      "folder.")
