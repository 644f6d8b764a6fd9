"""The package imports and generates on a CPU with triton unimportable (the README's first command
installs no extras)."""
import subprocess
import sys

_BLOCK = "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _BLOCK + code], capture_output=True, text=True, timeout=300)


def test_every_module_imports_without_triton():
    r = _run(
        "import importlib, pkgutil, specfire\n"
        "bad = []\n"
        "for m in pkgutil.walk_packages(specfire.__path__, 'specfire.'):\n"
        "    if m.name.endswith('__main__'):\n"
        "        continue\n"
        "    try:\n"
        "        importlib.import_module(m.name)\n"
        "    except Exception as e:\n"
        "        bad.append(f'{m.name}: {e!r}')\n"
        "print('\\n'.join(bad) or 'ok')\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok", r.stdout


def test_bundled_model_generates_without_triton():
    r = _run(
        "from specfire import LLM, SamplingParams, SpecPolicy\n"
        "with LLM() as llm:\n"
        "    for mode in ('off', 'mtp', 'ngram'):\n"
        "        res = llm.generate('def f(x):', SamplingParams(max_tokens=8), spec=SpecPolicy(mode=mode, k=2))\n"
        "        assert len(res.token_ids) == 8, res\n"
        "print('ok')\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("ok"), r.stdout


def test_a_kernel_without_triton_names_the_package():
    r = _run(
        "from specfire.kernels._triton import HAVE_TRITON, triton\n"
        "assert not HAVE_TRITON\n"
        "@triton.jit\n"
        "def k(x):\n"
        "    pass\n"
        "try:\n"
        "    k[(1,)](0)\n"
        "except RuntimeError as e:\n"
        "    print(e)\n")
    assert r.returncode == 0, r.stderr
    assert "needs triton" in r.stdout
