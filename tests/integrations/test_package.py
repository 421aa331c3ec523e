"""``gradtrace.integrations`` names what the docs call it by: ``checkpoints`` and ``segments`` read a store alone and
need no ``transformers``; ``GradtraceCallback`` is imported when first used."""

from __future__ import annotations

import subprocess
import sys

import gradtrace.integrations
import gradtrace.integrations.hf


def test_checkpoints_and_segments_are_the_hf_modules_functions():
    assert gradtrace.integrations.checkpoints is gradtrace.integrations.hf.checkpoints
    assert gradtrace.integrations.segments is gradtrace.integrations.hf.segments
    assert gradtrace.integrations.GradtraceCallback is gradtrace.integrations.hf.GradtraceCallback


def test_reading_checkpoints_does_not_import_transformers():
    code = ("import sys; from gradtrace.integrations import checkpoints, segments; "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
