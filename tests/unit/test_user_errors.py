"""Issue 23 item 5, outside the training core: every error a user can act on (a config field, a model
folder, the data, an OM model, a prompt) is a llmpipe.errors.UserError subclass, printed as one line;
the message is unchanged and it is still a ValueError for the callers that catch one."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from llmpipe.data.sampler import GlobalBatchSampler
from llmpipe.errors import UserError
from llmpipe.export import atc, atc_args
from llmpipe.infer import decode
from llmpipe.models.llama import flavors, model_args
from llmpipe.models.llama import io as model_io
from llmpipe.models.llama.model import Transformer


def _raised(call, *args, **kw) -> BaseException:
    with pytest.raises(Exception) as err:
        call(*args, **kw)
    return err.value


def _model_section(**kw):
    fields = dict(flavor="debug", init_from=None, dim=None, n_layers=None, n_heads=None, n_kv_heads=None,
                  ffn_dim=None, max_seq_len=None, rope_theta=None, norm_eps=None)
    return SimpleNamespace(**{**fields, **kw})


def test_an_unknown_flavor_is_a_user_error_naming_model_flavor():
    err = _raised(model_args, _model_section(flavor="no-such-model"))
    assert isinstance(err, flavors.FlavorError) and isinstance(err, UserError) and isinstance(err, ValueError)
    assert str(err).startswith("model.flavor: unknown flavor 'no-such-model' (known: debug, tiny,")


def test_a_model_folder_without_a_readable_model_config_is_a_user_error_naming_the_file(tmp_path):
    (tmp_path / model_io.CONFIG).write_text("{not json")
    err = _raised(model_io.read_args, tmp_path)
    assert isinstance(err, model_io.ModelConfigError) and isinstance(err, UserError)
    assert str(err).startswith(f"{tmp_path / model_io.CONFIG}: not a valid model config (")


def test_a_corpus_without_a_training_sample_is_a_user_error():
    err = _raised(GlobalBatchSampler, 0, micro_batch=2, grad_accum=1, world_size=1, seed=0)
    assert isinstance(err, UserError) and str(err) == "no training samples"


def test_a_prompt_beyond_the_context_is_a_user_error():
    torch.manual_seed(0)
    model = Transformer(flavors.FLAVORS["debug"])
    ids = np.zeros((1, model.args.max_seq_len), dtype=np.int64)
    err = _raised(decode.generate, decode.TorchEngine(model), ids, 2)
    assert isinstance(err, decode.CapacityError) and isinstance(err, UserError)
    assert str(err).startswith(f"prompt of {model.args.max_seq_len} tokens + 2 new tokens exceeds the context of ")


def test_an_atc_soc_version_it_does_not_know_is_a_user_error():
    err = _raised(atc_args.check_soc_version, "Ascend911")
    assert isinstance(err, atc_args.AtcArgsError) and isinstance(err, UserError)
    assert str(err).startswith("convert_om.soc_version: 'Ascend911' is not an Ascend SoC that ATC knows (closest: ")


def test_dynamic_dims_without_dynamic_input_dims_are_a_user_error():
    err = _raised(atc_args.check_dynamic_dims, "input_ids:1,128", "16;32")
    assert isinstance(err, atc_args.AtcArgsError) and isinstance(err, UserError)
    assert str(err) == ("convert_om.dynamic_dims ('16;32') needs -1 dims in convert_om.input_shape, but "
                        "'input_ids:1,128' has none")


def test_both_atc_precision_modes_are_a_user_error():
    section = SimpleNamespace(precision_mode="force_fp16", precision_mode_v2="fp16")
    err = _raised(atc.build_argv, section, "atc", "model.onnx", "model")
    assert isinstance(err, atc_args.AtcArgsError) and isinstance(err, UserError)
    assert str(err) == "convert_om: set precision_mode or precision_mode_v2, not both (ATC rejects both)"


def test_an_input_shape_naming_an_input_the_graph_lacks_is_a_user_error():
    section = SimpleNamespace(input_shape="ids:1,16", dynamic_dims=None)
    err = _raised(atc.check_prefill, section, {"input_ids": ["batch", "seq"]}, "model.onnx")
    assert isinstance(err, atc.AtcInputError) and isinstance(err, UserError)
    assert str(err) == ("convert_om.input_shape: 'ids:1,16' names input 'ids', which model.onnx does not have "
                        "(its inputs: input_ids)")
