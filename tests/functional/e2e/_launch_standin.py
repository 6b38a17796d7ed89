"""A user's training script as Megatron-LM core_r0.19.0's pretrain_gpt.py parses its arguments
(``from megatron.training.arguments import parse_and_validate_args``, then the call in the
``__main__`` block): nothing of megatron-ckpt-ext in the parsing. test_launch.py copies it next to
a stand-in ``megatron/training`` and runs it through ``python -m megatron_ckpt_ext.launch``.

The block after the parse is the test's instrument, not part of a user's script: it records what
the script saw in ``$STANDIN_RECORD`` (one JSON file per rank), then exits with
``$STANDIN_EXIT`` when that is set. ``$STANDIN_PROVIDER`` picks the script's
extra_args_provider: ``none`` (pretrain_gpt.py without modelopt), ``own`` (one adding
``--my-flag`` and its own ``--ckpt-load-threads``, as modelopt's ``add_modelopt_args`` adds
flags) or ``adapter`` (a script already edited to pass ``megatron_lm.extra_args_provider``).
"""

import json
import os
import sys

from megatron.training.arguments import parse_and_validate_args


def add_my_args(parser):
    parser.add_argument("--my-flag", type=int, default=0)
    parser.add_argument("--ckpt-load-threads", type=int, default=2)  # one of ours, redefined
    return parser


def _provider():
    choice = os.environ.get("STANDIN_PROVIDER", "none")
    if choice == "adapter":
        from megatron_ckpt_ext import megatron_lm

        return megatron_lm.extra_args_provider
    return add_my_args if choice == "own" else None


def _record(args):
    from megatron.training import arguments, checkpointing

    from megatron_ckpt_ext import megatron_lm

    proxy = checkpointing.dist_checkpointing
    return {
        "name": __name__,
        "argv": sys.argv,
        "path0": sys.path[0],
        "rank": os.environ.get("RANK"),
        "installed": megatron_lm.is_installed(),
        "proxy": type(proxy).__name__,
        # a second install would wrap the proxy in a proxy
        "proxied": type(getattr(proxy, "_real", None)).__name__,
        "parse_wrappers": _wrapper_depth(arguments.parse_and_validate_args),
        "args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
    }


def _wrapper_depth(fn):
    depth = 0
    while hasattr(fn, "__wrapped__"):
        fn, depth = fn.__wrapped__, depth + 1
    return depth


if __name__ == "__main__":
    args = parse_and_validate_args(
        extra_args_provider=_provider(),
        args_defaults={'tokenizer_type': 'GPT2BPETokenizer'},
    )
    record = os.environ["STANDIN_RECORD"]
    with open(f"{record}.{os.environ.get('RANK', '0')}", "w") as fh:
        json.dump(_record(args), fh)
    if os.environ.get("STANDIN_EXIT"):
        sys.exit(int(os.environ["STANDIN_EXIT"]))
