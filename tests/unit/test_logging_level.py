"""--logging-level shows our INFO lines in a script that configured no logging (the example
loop), and adds nothing where the script configured its own."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import logging
import megatron_ckpt_ext as mcx
{setup}
ck = mcx.Checkpointer(mcx.CkptOptions(logging_level={level}))
logging.getLogger("megatron_ckpt_ext.save").info("an info line of ours")
ck.close()
"""


def _stderr(level: int, setup: str = "") -> str:
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(level=level, setup=setup)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def test_logging_level_prints_our_info_lines_without_a_configured_handler():
    assert _stderr(20).count("an info line of ours") == 1


def test_logging_level_keeps_the_scripts_own_handler_and_prints_once():
    err = _stderr(20, setup="logging.basicConfig(format='mine: %(message)s')")
    assert err.count("an info line of ours") == 1 and "mine: an info line of ours" in err
