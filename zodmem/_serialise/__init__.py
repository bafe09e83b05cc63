"""`save` and `load`: a transform stack, and the arrays of every model inside it, in one file.

One idea a module, each using only those listed after it:

- `_save_load`: the public `save` and `load`;
- `_stack`: a transform stack described in the file's header, and rebuilt from it;
- `_values`: the tagged encoding of static configuration values;
- `_import_path`: the `module:qualname` that finds a function or class again;
- `_file`: the checksummed file format, written atomically;
- `_error`: `SerialisationError`.
"""

from ._error import SerialisationError as SerialisationError
from ._save_load import load as load, save as save

__all__ = ["SerialisationError", "load", "save"]
