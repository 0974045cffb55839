"""tkopt's own fuzzer: seeded random nn.Modules checked fused against eager on every path.

`python -m tkopt.fuzz --help` runs a campaign; `spec` draws graphs, `render` writes them as module
source, `paths` checks one on one path, `shrink` reduces a failure to a minimal reproducer.
"""
