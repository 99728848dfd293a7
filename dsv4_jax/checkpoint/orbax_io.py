"""Orbax round trip of the loadable model state (Params + tid2eid), with config.json saved beside it."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np

from ..config import ConfigError, DeepseekV4Config
from . import names as N
from .loader import CONFIG_NAME, canonical_state_dict, fill_abstract_model, model_constructor

STATE_DIR = "state"


def _config_dict(config: DeepseekV4Config) -> dict:
    try:
        return config.to_deepseek_dict()
    except ConfigError:
        return config.to_hf_dict()


def save_orbax(model, path, config: DeepseekV4Config | None = None) -> None:
    """Saves `model`'s parameters (canonical names and orientation, flat) with orbax to `path/state` and
    `path/config.json`."""
    import orbax.checkpoint as ocp

    config = config or model.config
    path = os.path.abspath(os.fspath(path))
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(_config_dict(config), f, indent=2)
    state = {k: jnp.asarray(v) for k, v in canonical_state_dict(model).items()}
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(os.path.join(path, STATE_DIR), state, force=True)
    ckptr.wait_until_finished()


def load_orbax(path, dtype=jnp.float32, attention_impl: str = "auto", *, model_factory=None, **model_options):
    """Inverse of :func:`save_orbax`; params are cast to the model built with `dtype`. model_options go to the
    model's constructor (e.g. expert_weights="fp4" for a model saved with its FP4 experts kept)."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    config = DeepseekV4Config.from_json_file(os.path.join(path, CONFIG_NAME))
    ctor = model_constructor(config, dtype, attention_impl, model_factory, **model_options)

    def values_fn(targets):
        ckptr = ocp.StandardCheckpointer()
        restored = ckptr.restore(os.path.join(path, STATE_DIR))
        missing = sorted(set(targets) - set(restored))
        extra = sorted(set(restored) - set(targets))
        want = {k: N.canonical_shape(k, targets[k].shape) for k in targets}   # saved in the canonical orientation
        bad = [f"{k}: {list(np.shape(restored[k]))} vs {list(want[k])}" for k in targets
               if k in restored and tuple(np.shape(restored[k])) != want[k]]
        if missing or extra or bad:
            from .loader import CheckpointMismatchError

            raise CheckpointMismatchError(missing, extra, bad, path=path)
        return {k: N.model_layout(k, jnp.asarray(restored[k]).astype(targets[k].dtype)) for k in targets}

    model = fill_abstract_model(ctor, values_fn)
    model.mtp_tensor_names = ()
    return model
