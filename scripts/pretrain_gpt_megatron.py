"""Megatron-LM's own ``pretrain_gpt.py``, with checkpointing routed through megatron-ckpt-ext.

The smallest real use: Megatron-LM's ``pretrain()`` and its GPT forward step, dataset provider
and model builders (``pretrain_gpt.py``, ``gpt_builders.py``, ``model_provider.py`` from a
Megatron-LM checkout: ``--mlm-dir`` or ``$MLM_DIR``, default ``.mlm/``). The only change to the
user's script is the argument hook:

* ``pretrain(..., extra_args_provider=...)`` where ``pretrain`` takes it (megatron-core <= 0.18);
* ``megatron_lm.parse_and_validate_args(...)`` then ``pretrain(cfg, ...)`` where it does not (0.19).

``--stock`` runs the same script without the adapter (stock Megatron checkpointing).
``MLM_RECORD=<file.jsonl>`` appends, on the last rank, one line per iteration with the exact
loss (``float.hex``) and the wall time at the start of the step, for the GPU verification driver.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["main"]


def _take_flag(argv: list[str], flag: str, *, value: bool = False) -> str | bool | None:
    """Remove our script-only ``flag`` from ``argv`` (Megatron's parser must not see it)."""
    if flag not in argv:
        return None
    i = argv.index(flag)
    del argv[i]
    return argv.pop(i) if value else True


def _import_megatron_lm_script(mlm_dir: Path) -> Any:
    missing = [f for f in ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py")
               if not (mlm_dir / f).exists()]
    if missing:
        raise SystemExit(f"{mlm_dir} lacks {missing}: copy them from Megatron-LM "
                         "(git show core_r0.19.0:pretrain_gpt.py ...) or pass --mlm-dir")
    sys.path.insert(0, str(mlm_dir))
    import pretrain_gpt

    return pretrain_gpt


def _recording_forward_step(forward_step: Callable, record: Path) -> Callable:
    """Wrap Megatron's forward step: log each step's exact loss and start time (last rank)."""
    from megatron.training import get_args

    def wrapped(data_iterator: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.time()
        output, loss_func = forward_step(data_iterator, model, *args, **kwargs)

        def recording_loss_func(*a: Any, **k: Any) -> Any:
            result = loss_func(*a, **k)
            loss, num_tokens = result[0], result[1]
            value = (loss.detach().double() / num_tokens.detach().double()).item()
            with record.open("a") as fh:
                fh.write(json.dumps({"iteration": get_args().curr_iteration + 1,
                                     "loss_hex": float(value).hex(), "loss": value,
                                     "t": started}) + "\n")
            return result

        return output, recording_loss_func

    return wrapped


def main(argv: list[str]) -> None:
    stock = bool(_take_flag(argv, "--stock"))
    mlm_dir = Path(_take_flag(argv, "--mlm-dir", value=True) or os.environ.get("MLM_DIR", ".mlm"))
    sys.argv = [sys.argv[0], *argv]
    gpt = _import_megatron_lm_script(mlm_dir.resolve())
    from megatron.core.enums import ModelType
    from megatron.training import pretrain

    from megatron_ckpt_ext import backend, megatron_lm

    forward_step = gpt.forward_step
    record = os.environ.get("MLM_RECORD")
    if record and int(os.environ.get("RANK", "0")) == int(os.environ.get("WORLD_SIZE", "1")) - 1:
        forward_step = _recording_forward_step(forward_step, Path(record))
    gpt.train_valid_test_datasets_provider.is_distributed = True
    provider = None if stock else megatron_lm.extra_args_provider
    seams = backend.megatron_training_seams()
    if seams.pretrain_extra_args_provider:  # megatron-core <= 0.18: pretrain parses
        pretrain(gpt.train_valid_test_datasets_provider, gpt.model_provider,
                 ModelType.encoder_or_decoder, forward_step, extra_args_provider=provider,
                 args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    else:  # megatron-core >= 0.19: parse, then pretrain(cfg, ...)
        _parse_then_pretrain(gpt, pretrain, forward_step, stock=stock)
    _dump_reports(stock)


def _parse_then_pretrain(gpt: Any, pretrain: Callable, forward_step: Callable, *, stock: bool) -> None:
    from megatron.core.enums import ModelType
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    from megatron_ckpt_ext import megatron_lm

    defaults = {"tokenizer_type": "GPT2BPETokenizer"}
    if stock:
        args = parse_and_validate_args(args_defaults=defaults)
    else:
        args = megatron_lm.parse_and_validate_args(args_defaults=defaults)
    config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    pretrain(config, gpt.train_valid_test_datasets_provider, ModelType.encoder_or_decoder,
             forward_step, get_embedding_ranks=gpt.get_embedding_ranks)


def _dump_reports(stock: bool) -> None:
    path = os.environ.get("MLM_REPORTS")
    if stock or not path or int(os.environ.get("RANK", "0")) != 0:
        return
    from megatron_ckpt_ext import megatron_lm

    Path(path).write_text(json.dumps(megatron_lm.reports(), indent=1, default=str))


if __name__ == "__main__":
    main(sys.argv[1:])
