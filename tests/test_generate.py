"""ikdflash generate: text on stdout, one line of statistics on stderr, errors as exit code 2."""

from __future__ import annotations

from ikdflash.cli import main


def test_generate_prints_text_and_statistics(tiny_model, tiny_draft, capsys):
    target = tiny_model("llama")
    draft = tiny_draft(target, target_layer_ids=[0, 2], layer_types=["sliding_attention", "full_attention"],
                       sliding_window=8)
    argv = ["generate", "--target", str(target), "--draft", str(draft), "--max-tokens", "12", "--threads", "2"]
    assert main(argv + ["--no-adaptive", "the river town"]) == 0
    out = capsys.readouterr()
    assert out.out.strip()
    lines = out.err.strip().splitlines()
    assert lines[0].startswith("dflash: 12 tokens (length)") and "acceptance" in lines[0] and "tau" in lines[0]
    assert lines[1].startswith("target alone: 12 tokens (length)")
    # a tiny model's pass takes a millisecond: the speeds are the machine's noise (see below)
    assert "x its speed" in lines[1] or "the two runs are too unlike to compare" in lines[1], lines[1]
    assert "outputs differ" not in lines[1]

    # the same text, cut before a stop string taken from it
    text = out.out.rstrip("\n")
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert main(argv + ["--stop", stop, "--no-compare", "the river town"]) == 0
    out = capsys.readouterr()
    assert out.out.rstrip("\n") == text[:text.find(stop)] and "(stop)" in out.err
    assert "target alone" not in out.err

    assert main(argv + ["--raw", "   "]) == 2
    assert "the prompt is empty" in capsys.readouterr().err
    assert main(["generate", "--target", str(target), "--draft", "missing.gguf", "hi"]) == 2
    assert "missing.gguf" in capsys.readouterr().err


def as_at_a_terminal() -> None:
    """Popen's preexec_fn: SIGINT back to its default, so that Python turns it into
    KeyboardInterrupt as at a terminal. A shell's background job (a CI script run with &, nohup)
    ignores SIGINT, its children inherit that, and Python then installs no handler."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def paused(process, point: str, seen: list[str]) -> None:
    """Read the command's stderr (into seen) until it says it waits at point (its environment's
    IKDFLASH_TEST_PAUSE, python/ikdflash/pausepoint.py): then a signal reaches it there."""
    import threading
    watchdog = threading.Timer(300, process.kill)  # a command that never gets there fails instead of hanging
    watchdog.start()
    try:
        for line in process.stderr:
            seen.append(line)
            if line.rstrip("\n") == f"ikdflash: paused at {point}":
                return
    finally:
        watchdog.cancel()
    raise AssertionError(f"the command did not pause at {point}: {''.join(seen)}")


def test_ctrl_c_ends_a_command_with_one_line(tiny_model, tmp_path):
    """SIGINT during a conversion ends it with a message, exit 130, no traceback and no partial
    output file. The conversion waits after its second tensor for the signal."""
    import os
    import signal
    import subprocess
    import sys

    from fixtures.tinydraft import write_hf_target, write_tiny_draft
    target = tiny_model("llama")
    hf = write_hf_target(tmp_path / "hf", target)
    draft = write_tiny_draft(tmp_path / "d", hf, target_layer_ids=[0])
    process = subprocess.Popen([sys.executable, "-m", "ikdflash.cli", "convert", str(draft), "--target-model-dir",
                                str(hf), "--outtype", "q8_0", "--outfile", str(tmp_path / "out.gguf")],
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "IKDFLASH_TEST_PAUSE": "convert@2"},
                               preexec_fn=as_at_a_terminal)
    seen: list[str] = []
    paused(process, "convert@2", seen)
    assert seen[0].startswith("[1/") and seen[1].startswith("[2/") and not seen[1].startswith("[2/2]")
    assert any(p.name.endswith(".partial") for p in tmp_path.iterdir())  # mid-write
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert err.strip() == "ikdflash convert: interrupted" and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "hf"]


def test_ctrl_c_ends_a_generation_after_its_current_step(tiny_model, tiny_draft):
    """Before, Ctrl-C during `ikdflash generate` waited for the generation to run to
    --max-tokens (here: minutes on 2 cores) before the one line and exit 130."""
    import os
    import signal
    import subprocess
    target, draft = chat_pair(tiny_model, tiny_draft)
    process = subprocess.Popen(["ikdflash", "generate", "--target", str(target), "--draft", str(draft), "--raw",
                                "-c", "8192", "--max-tokens", "6000", "--threads", "2", "the river town"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "IKDFLASH_TEST_PAUSE": "reply@1"}, preexec_fn=as_at_a_terminal)
    try:
        paused(process, "reply@1", [])
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130, err
    assert err.strip() == "ikdflash generate: interrupted"


def chat_pair(tiny_model, tiny_draft):
    target = tiny_model("llama")
    return target, tiny_draft(target, target_layer_ids=[0, 2], layer_types=["sliding_attention", "full_attention"],
                              sliding_window=8)


def test_chat_answers_each_turn_with_the_conversation_so_far(tiny_model, tiny_draft):
    import subprocess
    from ikdflash import Engine
    target, draft = chat_pair(tiny_model, tiny_draft)
    chat = ["ikdflash", "chat", "--target", str(target), "--draft", str(draft), "--max-tokens", "6", "--threads", "2"]
    # a line starting with "/" is a command, never a message: /help lists them, /nope is refused
    out = subprocess.run(chat, input="the river\n/help\n/nope\nand the town\n/reset\nand the town\n/exit\nlost\n",
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    replies = out.stdout.split("\n")[:3]
    stats = [line for line in out.stderr.splitlines() if line.startswith("dflash: ")]
    assert len(stats) == 3 and all("acceptance" in line for line in stats)
    assert "(a new conversation)" in out.stderr and "/reset   start a new conversation" in out.stderr
    assert "unknown command /nope; /help lists the commands (nothing was sent)" in out.stderr
    with Engine(target, draft, n_ctx=4096, n_threads=2) as engine:
        first = engine.chat([("user", "the river")], max_tokens=6).text
        second = engine.chat([("user", "the river"), ("assistant", first), ("user", "and the town")], max_tokens=6).text
        fresh = engine.chat([("user", "and the town")], max_tokens=6).text
    assert replies == [first, second, fresh]


def test_chat_drops_the_oldest_turns_and_ctrl_c_stops_a_reply(tiny_model, tiny_draft, tmp_path):
    """The fourth reply waits after its first piece for the signal; the chat goes on to /exit."""
    import os
    import signal
    import subprocess
    target, draft = chat_pair(tiny_model, tiny_draft)
    # three exchanges of ~100 + 400 tokens outgrow a context of 512
    (tmp_path / "in").write_text(("the river town and its bridges " * 12 + "\n") * 3 + "tell me everything\n/exit\n")
    with open(tmp_path / "in") as lines:
        proc = subprocess.Popen(["ikdflash", "chat", "--target", str(target), "--draft", str(draft), "-c", "512",
                                 "--max-tokens", "400", "--threads", "2"], stdin=lines, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, env={**os.environ, "IKDFLASH_TEST_PAUSE": "reply@4"},
                                preexec_fn=as_at_a_terminal)
    try:
        seen: list[str] = []
        paused(proc, "reply@4", seen)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    err = "".join(seen) + err
    assert proc.returncode == 0, err
    assert "oldest exchange" in err and "no longer fit the context of 512 tokens" in err
    assert len([line for line in err.splitlines() if line.startswith("dflash: ")]) == 4
    assert "(stopped)" in err.splitlines()[-1] and "Traceback" not in err


def test_generate_says_plainly_when_drafting_does_not_pay(tiny_model, tiny_draft, capsys, monkeypatch):
    """Costs where no draft pays: every token is decoded one at a time, and the line says so. On a
    tiny model a pass takes about a millisecond, so the two runs' speeds are the machine's noise:
    the comparison is either a ratio or the word that the runs were too unlike to compare."""
    monkeypatch.setenv("IKDFLASH_COSTS", "50:1,5")
    target = tiny_model("llama")
    draft = tiny_draft(target, target_layer_ids=[0, 2], layer_types=["sliding_attention", "full_attention"],
                       sliding_window=8)
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--max-tokens", "40", "--raw",
                 "--n-max", "1", "the river town"]) == 0
    dflash, alone = capsys.readouterr().err.strip().splitlines()
    assert "39 of 40 tokens decoded one at a time" in dflash
    assert alone.startswith("target alone: 40 tokens")
    assert "x its speed" in alone or "the two runs are too unlike to compare" in alone, alone


def test_the_comparison_says_whether_drafting_paid():
    from ikdflash.engine import SpeculationResult, SpeculationStats
    from ikdflash.cli.generate import comparison

    def result(seconds: float, steps: int = 39, drafted: int = 0, draft_seconds: float = 0.0,
               plain_steps: int = 0, looked_up: int = 0) -> SpeculationResult:
        stats = SpeculationStats(prompt_tokens=5, generated=40, drafted=drafted, accepted=39 - steps, steps=steps,
                                 prompt_time=0.0, draft_time=draft_seconds, verify_time=seconds,
                                 steps_by_verified=[plain_steps, 0], lookup_drafted=looked_up,
                                 lookup_accepted=looked_up)
        return SpeculationResult(text="", tokens=[1] * 40, stats=stats)

    slower = comparison(result(1.05, plain_steps=38), result(1.0))
    assert "DFlash 0.95x its speed: drafting does not pay for this pair on this machine; the adaptive block " \
           "length decoded 95% of the tokens without drafts" in slower
    assert comparison(result(0.45, steps=19, drafted=30, draft_seconds=0.05), result(1.0)).endswith(
        "DFlash 2.00x its speed (most kept tokens proposed by the draft)")
    # 20 kept: 15 from the lookup, 5 from the draft
    assert comparison(result(0.45, steps=19, drafted=30, draft_seconds=0.05, looked_up=15), result(1.0)).endswith(
        "DFlash 2.00x its speed (most kept tokens proposed by the lookup)")


def test_the_statistics_line_counts_its_probes():
    from ikdflash.engine import SpeculationStats
    from ikdflash.cli.stats import summary

    def line(probes: int) -> str:
        return summary("dflash", SpeculationStats(prompt_tokens=5, generated=40, drafted=1, accepted=0, steps=40,
                                                  prompt_time=0.0, draft_time=0.001, verify_time=0.1,
                                                  steps_by_verified=[39, 1], probes=probes), "length")

    assert line(1).endswith("39 of 40 tokens decoded one at a time (1 probe)")
    assert line(2).endswith("(2 probes)")


def test_a_run_that_was_all_prompt_pass_is_not_compared():
    """--max-tokens 1 (or a stop at the first token): the token comes from the prompt's pass, so a
    run has no generation time, hence no speed; the line has no ratio (it divided by zero)."""
    from ikdflash.engine import SpeculationResult, SpeculationStats
    from ikdflash.cli.generate import comparison

    stats = SpeculationStats(prompt_tokens=5, generated=1, drafted=0, accepted=0, steps=0, prompt_time=0.01,
                             draft_time=0.0, verify_time=0.0)
    one = SpeculationResult(text="a", tokens=[1], stats=stats)
    assert comparison(one, one) == "target alone: 1 tokens (length), 0.0 tok/s"


def test_the_comparison_refuses_runs_too_unlike_to_compare():
    """A ratio past what the runs' own counts allow (docs/commands.md#generate) is the machine's
    speed changing between them: one draft in 40 tokens cannot make DFlash 4x faster, nor can
    one pass for each token and one cheap draft make it 4x slower. Just inside the bounds, the
    ratio is printed."""
    from ikdflash.engine import SpeculationResult, SpeculationStats
    from ikdflash.cli.generate import SLACK, comparison, ratio_bounds

    def result(seconds: float, steps: int = 39, drafted: int = 0, draft_seconds: float = 0.0) -> SpeculationResult:
        stats = SpeculationStats(prompt_tokens=5, generated=40, drafted=drafted, accepted=39 - steps, steps=steps,
                                 prompt_time=0.0, draft_time=draft_seconds, verify_time=seconds)
        return SpeculationResult(text="", tokens=[1] * 40, stats=stats)

    plain = result(1.0)
    one_draft = result(0.25, steps=38, drafted=1, draft_seconds=0.001)
    assert "the two runs are too unlike to compare (DFlash read 3.98x" in comparison(one_draft, plain)
    other = SpeculationResult(text="", tokens=[2] * 40, stats=one_draft.stats)
    assert comparison(other, plain).endswith("between them) (outputs differ!)")  # said whatever the timing
    assert "too unlike" in comparison(result(4.0), plain)
    low, high = ratio_bounds(result(1.0, steps=38, drafted=1, draft_seconds=0.001).stats, plain.stats)
    for ratio in (low / SLACK * 1.01, high * SLACK * 0.99):
        line = comparison(result(1.0 / ratio, steps=38, drafted=1, draft_seconds=0.001), plain)
        assert "too unlike" not in line and f"DFlash {ratio:.2f}x its speed" in line, line
    for ratio in (low / SLACK * 0.99, high * SLACK * 1.01):
        assert "too unlike" in comparison(result(1.0 / ratio, steps=38, drafted=1, draft_seconds=0.001), plain)


def test_the_built_in_pairs_chat_defaults_apply_unless_overridden():
    import argparse

    from ikdflash.cli.decoding import decoding_options, system_message
    from ikdflash.cli.generate import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    builtin = parser.parse_args(["hi"])
    assert system_message(builtin) == "You are a helpful assistant."
    assert decoding_options(builtin) == {"n_max": None, "adaptive": True, "lookup": True, "confidence": False,
                                         "conf_min": 0.0, "repeat_penalty": 1.1}  # None: 4, or fewer
    mine = parser.parse_args(["--repeat-penalty", "1.0", "--system", "Be brief.", "--no-adaptive", "hi"])
    assert system_message(mine) == "Be brief." and decoding_options(mine)["repeat_penalty"] == 1.0
    assert decoding_options(mine)["adaptive"] is False
    files = parser.parse_args(["--target", "t.gguf", "--draft", "d.gguf", "hi"])
    assert system_message(files) is None and decoding_options(files) == {"n_max": None, "adaptive": True, "lookup": True,
                                                                         "confidence": False, "conf_min": 0.0}
