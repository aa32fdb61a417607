"""ikdflash generate: text on stdout, one line of statistics on stderr, errors as exit code 2."""

from __future__ import annotations

from ikdflash.cli import main


def test_generate_prints_text_and_statistics(tiny_model, tiny_draft, capsys):
    target = tiny_model("llama")
    draft = tiny_draft(target, target_layer_ids=[0, 2], layer_types=["sliding_attention", "full_attention"],
                       sliding_window=8)
    argv = ["generate", "--target", str(target), "--draft", str(draft), "--max-tokens", "12", "--threads", "2"]
    assert main(argv + ["--compare", "the river town"]) == 0
    out = capsys.readouterr()
    assert out.out.strip()
    lines = out.err.strip().splitlines()
    assert lines[0].startswith("dflash: 12 tokens (length)") and "acceptance" in lines[0] and "tau" in lines[0]
    assert lines[1].startswith("target alone: 12 tokens (length)") and "speed-up" in lines[1]
    assert "outputs differ" not in lines[1]

    # the same text, cut before a stop string taken from it
    text = out.out.rstrip("\n")
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert main(argv + ["--stop", stop, "the river town"]) == 0
    out = capsys.readouterr()
    assert out.out.rstrip("\n") == text[:text.find(stop)] and "(stop)" in out.err

    assert main(argv + ["--raw", "   "]) == 2
    assert "the prompt is empty" in capsys.readouterr().err
    assert main(["generate", "--target", str(target), "--draft", "missing.gguf", "hi"]) == 2
    assert "missing.gguf" in capsys.readouterr().err
