"""Importing the package pulls in no backend, and works with neither backend installed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

HIDE_BACKENDS = textwrap.dedent("""
    import importlib.abc, sys
    class _Hide(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split('.')[0] in ('nvidia_resiliency_ext', 'megatron'):
                raise ModuleNotFoundError(f'hidden by test: {name}')
    sys.meta_path.insert(0, _Hide())
""")


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_import_does_not_load_backends():
    r = run("import sys, megatron_ckpt_ext, megatron_ckpt_ext.options, megatron_ckpt_ext.validation\n"
            "print(sorted(m for m in sys.modules if m.startswith(('megatron.', 'nvidia_resiliency_ext'))))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_import_and_parse_work_with_backends_hidden():
    r = run(HIDE_BACKENDS + textwrap.dedent("""
        import argparse, megatron_ckpt_ext as m
        try:
            import nvidia_resiliency_ext
        except ModuleNotFoundError:
            pass
        else:
            raise SystemExit('hiding failed')
        opts = m.CkptOptions.from_args(m.add_arguments(argparse.ArgumentParser()).parse_args(['--async-save']))
        print(opts.async_save)
    """))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True"
