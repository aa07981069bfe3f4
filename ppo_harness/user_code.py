"""The user's code a flag names, `path/to/file.py:name` or `module:name`: the module imported, and a
failure named with the flag (a file that is not there, an import that fails, an error while the file
runs). `reward_fns` loads reward functions through it, `environments` environments."""
import importlib
import importlib.util
from pathlib import Path


def import_user_module(module_name: str, flag: str, spec: str):
    """`module_name` (a .py file's path, or an importable name) imported; refused as `{flag} {spec!r}`."""
    try:
        if module_name.endswith(".py"):
            module_spec = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
            if module_spec is None or not Path(module_name).is_file():
                raise FileNotFoundError(module_name)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
            return module
        return importlib.import_module(module_name)
    except (ImportError, FileNotFoundError) as e:
        raise ValueError(f"{flag} {spec!r}: cannot import {module_name!r} ({e})") from e
    except Exception as e:  # a SyntaxError, NameError... while the file runs
        raise ValueError(f"{flag} {spec!r}: loading {module_name!r} raised {type(e).__name__}: {e}") from e
