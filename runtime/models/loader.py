"""Load a servable model from a spec string.

A spec is one of:

* a builtin name: ``mlp``, ``encoder``, ``minilm``, ``wide`` (see ``runtime.models.BUILTIN_MODELS``);
* ``package.module:ClassName`` — imported with ``importlib``;
* ``path/to/file.py:ClassName`` — imported from that file;
* ``hf:DIR``, ``onnx:FILE``, ``pt2:FILE`` with ``,key=value`` options — a model file or
  directory served as it is (``runtime.models.files``);

optionally prefixed with ``served_name=`` to serve it under another name (``fast=mlp``).
The class must subclass ``runtime.api.model.ModelAPI`` (request/response models) or
``runtime.generation.model.GenerationModel`` (token generation with continuous batching)
and take no constructor arguments (a module-level instance is accepted too). Every mistake raises
``ConfigError`` saying what was wrong and what to write instead.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

from runtime.api.errors import ConfigError
from runtime.api.model import ModelAPI, check_model
from runtime.models import BUILTIN_MODELS
from runtime.models.files import is_file_spec, load_file_model

_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")

_EXAMPLE = """\
    from runtime.api.model import ModelAPI, TensorSpec

    class {cls}(ModelAPI):
        name = "my-model"
        inputs = [TensorSpec("INPUT0", "FP32", (256,))]
        outputs = [TensorSpec("OUTPUT0", "FP32", (10,))]
        def setup(self, device): ...
        def decode(self, inputs): ...
        def collate(self, items, pad_to): ...
        def predict(self, batch): ...
        def split(self, output, n): ..."""


def parse_spec(spec: str) -> tuple[str | None, str]:
    """Split ``[served_name=]target``; the served name is None when not given."""
    spec = spec.strip()
    if not spec:
        raise ConfigError("empty model spec: give a builtin name "
                          f"({', '.join(sorted(BUILTIN_MODELS))}), module:Class or path/file.py:Class")
    head, sep, tail = spec.partition("=")
    if sep and ":" not in head and "/" not in head:
        if not head:
            raise ConfigError(f"empty model name in {spec!r}: write served_name=target, e.g. fast=mlp")
        if not _NAME.match(head):
            raise ConfigError(f"model name {head!r} in {spec!r} may only hold letters, digits, '_', '-', '.'")
        if not tail:
            raise ConfigError(f"model spec {spec!r} names the model but not what to load: write {head}=mlp")
        return head, tail
    return None, spec


def load_model(spec: str) -> Any:
    """Instantiate and validate the model a spec names (see the module docstring)."""
    served_name, target = parse_spec(spec)
    if target in BUILTIN_MODELS:
        model = _instantiate(_resolve(BUILTIN_MODELS[target]), target)
    elif is_file_spec(target):
        model = load_file_model(target)
    elif ":" in target:
        model = _instantiate(_resolve(target), target)
    else:
        raise ConfigError(
            f"unknown model {target!r}: use a builtin name ({', '.join(sorted(BUILTIN_MODELS))}), "
            "package.module:ClassName, path/to/file.py:ClassName, or a model file: hf:DIR, "
            "onnx:FILE, pt2:FILE")
    if served_name is not None:
        model.name = served_name
    if is_generation_model(model):
        if not model.name:
            raise ConfigError(f"generation model {target!r} needs a class attribute `name = \"my-decoder\"`")
        return model
    try:
        check_model(model)
    except (TypeError, NotImplementedError) as exc:
        raise ConfigError(f"model {target!r} is incomplete: {exc}") from None
    return model


def _resolve(target: str) -> Any:
    where, _, attr = target.rpartition(":")
    if not where or not attr:
        raise ConfigError(f"model spec {target!r} must look like module:ClassName or path/file.py:ClassName")
    module = _import_file(where) if where.endswith(".py") or "/" in where else _import_module(where)
    try:
        return getattr(module, attr)
    except AttributeError:
        found = sorted(n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, ModelAPI)
                       and v is not ModelAPI)
        hint = f"; ModelAPI classes there: {', '.join(found)}" if found else ""
        raise ConfigError(f"{where} has no attribute {attr!r}{hint}") from None


def _import_module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"cannot import module {name!r}: {exc}. Check the spelling, that the package is "
                          "installed, or give a file path instead (path/to/file.py:ClassName)") from None
    except Exception as exc:
        raise ConfigError(f"importing module {name!r} failed: {type(exc).__name__}: {exc}") from exc


def _import_file(path_text: str) -> Any:
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"model file {path_text!r} does not exist (looked at {path})")
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module_name = f"batchscope_user_model_{path.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"model file {path_text!r} is not an importable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise ConfigError(f"importing {path_text!r} failed: {type(exc).__name__}: {exc}") from exc
    return module


def _generation_base() -> type:
    from runtime.generation.model import GenerationModel

    return GenerationModel


def is_generation_model(model: Any) -> bool:
    """True for models served with continuous batching at /v1/completions."""
    return isinstance(model, _generation_base())


def _instantiate(obj: Any, target: str) -> Any:
    if isinstance(obj, (ModelAPI, _generation_base())):
        return obj
    if isinstance(obj, type) and issubclass(obj, _generation_base()):
        try:
            return obj()
        except TypeError as exc:
            raise ConfigError(f"cannot create {obj.__name__}() from {target!r}: {exc}. Model classes "
                              "are created without arguments") from None
    if not isinstance(obj, type):
        raise ConfigError(f"{target!r} is a {type(obj).__name__}, not a model class; it must be a "
                          "subclass of runtime.api.model.ModelAPI:\n\n" + _EXAMPLE.format(cls="MyModel"))
    if not issubclass(obj, ModelAPI):
        raise ConfigError(f"class {obj.__name__} in {target!r} does not subclass "
                          "runtime.api.model.ModelAPI; write it as:\n\n" + _EXAMPLE.format(cls=obj.__name__))
    try:
        return obj()
    except ConfigError:
        raise
    except TypeError as exc:
        raise ConfigError(f"cannot create {obj.__name__}() from {target!r}: {exc}. Model classes are "
                          "created without arguments; read settings in __init__ or setup()") from None
