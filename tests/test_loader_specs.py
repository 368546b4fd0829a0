"""Loading models by builtin name, module:Class and path/file.py:Class."""

from __future__ import annotations

import textwrap

import pytest

from runtime.api.errors import ConfigError
from runtime.models.loader import load_model, parse_spec
from runtime.models.encoder import EncoderModel
from runtime.models.mlp import MLPModel

GOOD = """
    import numpy as np, torch
    from runtime.api.model import ModelAPI, TensorSpec

    class Doubler(ModelAPI):
        name = "doubler"
        inputs = [TensorSpec("X", "FP32", (4,))]
        outputs = [TensorSpec("Y", "FP32", (4,))]
        def decode(self, inputs): return torch.from_numpy(inputs["X"])
        def collate(self, items, pad_to): return torch.stack(items)
        def predict(self, batch): return batch * 2
        def split(self, output, n): return [{"Y": output[i].numpy()} for i in range(n)]

    class Incomplete(ModelAPI):
        name = "incomplete"
        inputs = [TensorSpec("X", "FP32", (4,))]

    class NotAModel:
        pass

    class NeedsArgs(Doubler):
        def __init__(self, path): self.path = path
"""


@pytest.fixture()
def user_file(tmp_path):
    path = tmp_path / "user_models.py"
    path.write_text(textwrap.dedent(GOOD))
    return path


def test_builtin_names():
    assert isinstance(load_model("mlp"), MLPModel)
    enc = load_model("encoder")
    assert isinstance(enc, EncoderModel) and enc.name == "encoder"


def test_rename_with_equals():
    m = load_model("fast=mlp")
    assert m.name == "fast" and isinstance(m, MLPModel)
    assert MLPModel.name == "mlp"  # the class keeps its own name
    assert parse_spec("a=pkg.mod:Cls") == ("a", "pkg.mod:Cls")
    assert parse_spec("dir=1/file.py:C") == ("dir", "1/file.py:C")
    assert parse_spec("some/dir=x/file.py:C") == (None, "some/dir=x/file.py:C")


def test_module_and_class():
    m = load_model("runtime.models.encoder:EncoderModel")
    assert isinstance(m, EncoderModel)


def test_file_and_class_runs(user_file):
    import numpy as np

    m = load_model(f"{user_file}:Doubler")
    assert m.name == "doubler"
    out = m.split(m.predict(m.collate([m.decode({"X": np.ones(4, np.float32)})], None)), 1)
    assert out[0]["Y"].tolist() == [2, 2, 2, 2]
    assert type(load_model(f"{user_file}:Doubler")) is type(m)  # imported once


@pytest.mark.parametrize("spec, words", [
    ("nosuch", "unknown model 'nosuch'"),
    ("no_such_module_xyz:Thing", "cannot import module 'no_such_module_xyz'"),
    ("runtime.models.mlp:Nope", "has no attribute 'Nope'; ModelAPI classes there: MLPModel"),
    ("runtime.models.mlp:build_mlp", "not a model class"),
    ("/does/not/exist.py:X", "does not exist"),
    ("=mlp", "empty"),
    ("name=", "names the model but not what to load"),
    ("", "empty model spec"),
])
def test_bad_specs_say_what_was_wrong(spec, words):
    with pytest.raises(ConfigError) as err:
        load_model(spec)
    assert words in err.value.message


def test_bad_classes_in_a_file(user_file):
    with pytest.raises(ConfigError, match="must implement `decode`") as err:
        load_model(f"{user_file}:Incomplete")
    assert "def decode(self, inputs)" in err.value.message
    with pytest.raises(ConfigError, match="does not subclass runtime.api.model.ModelAPI") as err:
        load_model(f"{user_file}:NotAModel")
    assert "class NotAModel(ModelAPI)" in err.value.message
    with pytest.raises(ConfigError, match="created without arguments"):
        load_model(f"{user_file}:NeedsArgs")


def test_file_with_import_error(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("raise RuntimeError('weights missing')\n")
    with pytest.raises(ConfigError, match="RuntimeError: weights missing"):
        load_model(f"{bad}:Anything")
