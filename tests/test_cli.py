"""`specjax generate` / `init-drafter` end to end on a tiny checkpoint (text streamed, then the measurements)."""

import json

from specjax.cli import main


def test_generate_with_random_drafter_prints_text_and_stats(tiny_dirs, tmp_path, capsys):
    drafter = str(tmp_path / "drafter")
    assert main(["init-drafter", "--target", tiny_dirs["qwen3"], "--out", drafter, "--layers", "1",
                 "--block-size", "8", "--target-layer-ids", "0,2", "--mask-token-id", "299"]) == 0
    assert "wrote a random DFlash drafter" in capsys.readouterr().out
    assert main(["generate", "hello there", "--model", tiny_dirs["qwen3"], "--drafter", drafter,
                 "--max-new-tokens", "12", "--max-model-len", "128", "--compile-cache", "", "--json"]) == 0
    out, err = capsys.readouterr()
    record = json.loads(out.strip().splitlines()[-1])
    assert record["method"] == "dflash" and record["new_tokens"] >= 1 and record["tau"] >= 1
    assert "tau (mean acceptance length, bonus counted)" in err and "acceptance histogram" in err
    # the default: fixed K, capped at 3 on a CPU (a block of 8 could verify 7), nothing adaptive, prompt lookup
    # standing in for the drafter where the context repeats 4 tokens
    assert "dflash (block 8, K=3), prompt lookup at >= 4 tokens | load" in err and "adaptive" not in err


def test_generate_plain_decoding_no_chat(tiny_dirs, capsys):
    assert main(["generate", "abc", "--model", tiny_dirs["llama"], "--method", "ar", "--no-chat",
                 "--max-new-tokens", "5", "--max-model-len", "64", "--compile-cache", "", "--warmup", "none"]) == 0
    err = capsys.readouterr().err
    assert "--- ar |" in err
    # nothing compiled ahead: the first decode step built its program, and the tok/s without that wait is printed
    assert "tok/s without the" in err and "waited for their program to load or compile" in err


def test_generate_adaptive_k_gives_the_plain_decoding_text(tiny_dirs, tmp_path, capsys):
    drafter = str(tmp_path / "drafter")
    assert main(["init-drafter", "--target", tiny_dirs["qwen3"], "--out", drafter, "--layers", "1",
                 "--block-size", "4", "--target-layer-ids", "0,2", "--mask-token-id", "299"]) == 0
    common = ["generate", "count with me", "--model", tiny_dirs["qwen3"], "--max-new-tokens", "16",
              "--max-model-len", "128", "--compile-cache", "", "--json"]
    texts, errs = [], []
    for extra in (["--method", "ar"], ["--drafter", drafter, "--adaptive-k"]):
        capsys.readouterr()
        assert main(common + extra) == 0
        out, err = capsys.readouterr()
        texts.append(json.loads(out.strip().splitlines()[-1])["text"])
        errs.append(err)
    assert texts[0] == texts[1]
    assert "dflash (block 4, K=3), adaptive K in (0, 1, 3)" in errs[1]


def test_generate_saves_its_step_programs_and_the_next_run_loads_them(tiny_dirs, tmp_path, capsys,
                                                                     no_jax_compile_cache):
    """--compile-cache DIR: the step programs go to DIR-programs (jax's own cache stays off in this process), and
    a second run loads each of them (the same files, not rewritten) and prints the same text."""
    import os

    common = ["generate", "abc", "--model", tiny_dirs["llama"], "--method", "ar", "--max-new-tokens", "6",
              "--max-model-len", "64", "--compile-cache", str(tmp_path / "xla"), "--json"]
    texts, entries = [], []
    for _ in range(2):
        assert main(common) == 0
        texts.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"])
        programs = tmp_path / "xla-programs"
        entries.append({name: os.stat(programs / name).st_ino for name in os.listdir(programs)})
    assert texts[0] == texts[1] and len(entries[0]) >= 4 and entries[0] == entries[1]
    assert not (tmp_path / "xla").exists()  # jax's persistent cache was not used
