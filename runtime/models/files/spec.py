"""``KIND:PATH[,key=value...]``: a model file or directory to serve, and its options.

``hf:models/minilm,task=embeddings`` serves a Hugging Face directory,
``onnx:encoder.onnx,provider=cpu`` an ONNX graph, ``pt2:mlp.pt2`` a saved
``torch.export`` program. ``FileSpec.parse`` checks the kind, that the path exists
and that every option is one the kind takes with a value it accepts; anything else is a
``ConfigError`` saying what to write instead, so ``batchscope serve`` refuses to start
with one line rather than a traceback from deep inside a loader.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from runtime.api.errors import ConfigError

#: kind -> option -> accepted values (None: any text; "int"/"bool": parsed)
OPTIONS: dict[str, dict[str, tuple[str, ...] | str | None]] = {
    "hf": {"task": ("embeddings", "classification", "generation"),
           "truncate": "bool", "max_length": "int", "dtype": ("float32", "float16", "bfloat16")},
    "onnx": {"provider": ("auto", "cpu", "cuda", "tensorrt"), "max_length": "int"},
    "pt2": {"max_length": "int"},
}
KINDS = tuple(OPTIONS)
_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.\-]+")


@dataclass(frozen=True, slots=True)
class FileSpec:
    kind: str
    path: Path
    options: Mapping[str, str | int | bool] = field(default_factory=dict)

    @classmethod
    def parse(cls, target: str) -> "FileSpec":
        kind, _, rest = target.partition(":")
        if kind not in OPTIONS:
            raise ConfigError(f"unknown model file kind {kind!r} in {target!r}: use "
                              + ", ".join(f"{k}:PATH" for k in KINDS))
        path_text, *pairs = rest.split(",")
        if not path_text:
            raise ConfigError(f"{target!r} names no path: write {kind}:path/to/model")
        path = Path(path_text).expanduser()
        if not path.exists():
            raise ConfigError(f"{kind}:{path_text}: {path.resolve()} does not exist")
        options: dict[str, str | int | bool] = {}
        allowed = OPTIONS[kind]
        for pair in pairs:
            key, sep, value = pair.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or not key:
                raise ConfigError(f"option {pair!r} in {target!r} must be key=value")
            if key not in allowed:
                raise ConfigError(f"{kind}: models take no option {key!r}; they take "
                                  + ", ".join(sorted(allowed)))
            options[key] = _value(kind, key, value, allowed[key])
        return cls(kind, path, options)

    def option(self, key: str, default: str | int | bool | None = None) -> str | int | bool | None:
        return self.options.get(key, default)

    def default_name(self) -> str:
        """The served name when none is given: the file or directory name without suffix."""
        stem = self.path.resolve().name
        if self.path.is_file():
            stem = stem.rsplit(".", 1)[0]
        return _NAME_CHARS.sub("-", stem).strip("-") or self.kind

    def describe(self) -> dict[str, object]:
        """What model metadata, Triton's config and the dashboard show about the source."""
        return {"kind": self.kind, "path": str(self.path.resolve()), **dict(self.options)}


def _value(kind: str, key: str, text: str, accepted: tuple[str, ...] | str | None) -> str | int | bool:
    if accepted == "int":
        try:
            number = int(text)
        except ValueError:
            raise ConfigError(f"{kind}: option {key}={text!r} must be a whole number") from None
        if number < 1:
            raise ConfigError(f"{kind}: option {key}={number} must be at least 1")
        return number
    if accepted == "bool":
        lowered = text.lower()
        if lowered not in ("true", "false", "1", "0", "yes", "no"):
            raise ConfigError(f"{kind}: option {key}={text!r} must be true or false")
        return lowered in ("true", "1", "yes")
    if isinstance(accepted, tuple) and text not in accepted:
        raise ConfigError(f"{kind}: option {key}={text!r} must be one of {', '.join(accepted)}")
    return text
