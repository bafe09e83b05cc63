"""Drop-in namespaces for users of zodiax, powerpax and optax.microbatching.

Each submodule offers the anchor's names, arguments and results as thin functions
over zodmem's transforms, so moving over is a change of import.
"""
