"""What the servers are driven with: the prompt sets, the scenarios, and the load generator that runs one
scenario against one server and sums up its requests."""
from __future__ import annotations

import asyncio
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import psutil

from .code_edits import CODE, CODE_EDITS, CODE_NEW_TOKENS, build_code_prompts
from .meters import CpuMeter
from bench.harness.paths import MODEL_DIR

if TYPE_CHECKING:
    from .servers import RequestResult, Server

# The prompt set: varied English prompts of 20-60 tokens (SmolLM2 tokenizer), written for this benchmark.
PROMPTS = [
    "The old bridge over the river had been closed for repairs since early spring, so every morning the "
    "villagers walked an extra mile to reach the market on the other side. One foggy Tuesday, the baker's "
    "son decided to",
    "On a clear day the sky looks blue, but in the evening it turns red and orange. The reason has to do "
    "with the way sunlight travels through the air: blue light",
    "My grandmother kept a small notebook of recipes in her kitchen drawer. The first page, stained with "
    "butter and flour, described how to bake a honey cake for birthdays, and the second page",
    "In the year 1850, a young cartographer set out from Lisbon with a leather satchel, three compasses and "
    "a letter of introduction addressed to the governor of a distant colony. On the third week of the voyage,",
    "Explain in simple terms how a refrigerator keeps food cold, as if you were talking to a curious "
    "ten-year-old who has just asked where the cold comes from.",
    "The meeting had already lasted two hours when Sarah finally raised her hand and said that the budget "
    "numbers did not add up. The finance director frowned, opened his laptop and",
    "Here is a list of five practical tips for someone who is learning to play the guitar for the very "
    "first time:",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to produce "
    "glucose and oxygen. It takes place mostly in the leaves, inside small structures called chloroplasts, "
    "which",
    "The train left the station twenty minutes late. Outside the window, fields of wheat stretched to the "
    "horizon, and the passenger in seat 14B had not looked up from her book since",
    "A good night's sleep matters more than most people think. Researchers who study memory have found that "
    "during deep sleep",
    "Dear hiring manager, I am writing to apply for the position of junior software engineer that was "
    "advertised on your company's website last week. During my studies I built",
    "The lighthouse keeper counted the steps every evening as he climbed to the lamp room, and on the "
    "night of the great storm, when the waves reached higher than the rocks, he noticed a small boat",
    "Crocodiles and alligators look alike at first glance, but there are a few simple ways to tell them "
    "apart, such as where they live, the shape of their snouts and",
    "When the power went out across the whole city, the small bakery on Elm Street was the only shop that",
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type with an oil-based ink and a wooden press adapted from the ones used to make wine. "
    "Within fifty years,",
    "To make a simple tomato sauce, start by warming olive oil in a heavy pan over medium heat, then add "
    "chopped garlic and a pinch of salt. After a minute or two,",
    "Our team finished the marathon in just under four hours, which surprised everyone, especially our "
    "coach, who had predicted that we would need at least five. At the finish line",
    "The museum's newest exhibit features ancient pottery, bronze tools and woven baskets recovered from a "
    "settlement near the coast that was buried by sand about three thousand years ago. In the first room, "
    "visitors will find",
    "Summarise the plot of a story about a robot who wakes up in an abandoned library and decides to read "
    "every book on the shelves before the building is torn down.",
    "Mountains form over millions of years as tectonic plates collide, fold and push the crust upward. The "
    "Himalayas, for example, are still rising by a few millimetres every year because",
    "It was the first snowfall of the winter, and the children on Maple Avenue ran outside before "
    "breakfast to build",
    "There are three good reasons why regular exercise helps both the body and the mind. The first "
    "reason is that",
    "The scientist adjusted her microscope, took a deep breath and looked again at the sample that had "
    "arrived from the research station in Antarctica that morning. What she saw there was",
    "The committee reviewed the proposal for a new public library in three long sessions. The architects "
    "wanted glass walls and a rooftop garden, the librarians asked for quiet reading rooms and more "
    "shelves, and the mayor, who worried about the cost of heating such a building through the winter, "
    "suggested",
    "Every Saturday the farmers' market fills the town square with stalls of fresh bread, honey, cheese "
    "and vegetables, and the most popular stall, run by an old man with a straw hat, sells",
]
PROMPT_32_TOKENS = 32
CONCURRENCY_SWEEP = ("c1", "c8-32tok", "c16")  # scenarios alike but for their client count: the chart's x axis
LONG_PROMPT_TOKENS, LONG_NEW_TOKENS = 768, 256  # c16-1024: maxInputTokenLen + the rest of maxSeqLen 1024
SYSTEM_PROMPT_TOKENS, QUESTION_TOKENS = 512, 16  # c8-prefix: a shared system prompt, a question each
PREFIX = "prefix"  # c8-prefix's key in the prompt sets
QUOTE, QUOTE_NEW_TOKENS = "quote", 160  # c1-quote's key in the prompt sets, and its new-token cap

# Issue 25's quote-heavy workload: chat requests (the default model's ChatML) whose answer copies a passage of
# the prompt — repeat it, fix its spelling, keep it as it is under a heading. Written for this benchmark.
PASSAGES = [
    "The committee met on Tuesday to review the harbour repairs. The north wall, damaged in the March storms, has "
    "been rebuilt with granite blocks from the old quarry, and the fishing boats returned to their moorings last "
    "week. Work on the south pier will begin in June, once the tides are lower.",
    "To reset the router, unplug it from the wall and wait thirty seconds. Plug it back in and wait until the "
    "green light stops blinking, which can take up to two minutes. If the light turns red, hold the small button "
    "on the back for ten seconds and try again.",
    "Our library opens at nine on weekdays and at ten on Saturdays. Books may be borrowed for three weeks and "
    "renewed twice online. Children under twelve need a parent to sign their card, and the reading room on the "
    "second floor is reserved for quiet study.",
    "Preheat the oven to 180 degrees. Mix the flour, sugar and baking powder in a large bowl, then add two eggs, "
    "a cup of milk and the melted butter. Pour the batter into a greased tin and bake for forty minutes, until a "
    "knife comes out clean.",
]
QUOTE_ASKS = ["Repeat the following passage exactly, word for word.",
              "Copy this text exactly as it is written.",
              "Rewrite the passage below without changing any words."]
# A base model (no chat template) is not asked: it continues a document followed by a line announcing its copy.
QUOTE_LEADS = ["The same text again:", "The same notice, copied exactly:", "Again, word for word:"]


def build_quote_prompts(base: bool = False) -> list[str]:
    """Every ask with every passage: a user turn and the opening of the assistant's (ChatML); ``base``: the passage
    and a lead line for a base model to continue."""
    if base:
        return [f"{passage}\n\n{lead}\n\n" for passage in PASSAGES for lead in QUOTE_LEADS]
    return [f"<|im_start|>user\n{ask}\n\n{passage}<|im_end|>\n<|im_start|>assistant\n"
            for passage in PASSAGES for ask in QUOTE_ASKS]


@dataclass(frozen=True)
class Scenario:
    name: str
    concurrency: int
    requests: int
    fixed_prompt_tokens: int | None  # None: the varied set
    max_new: int | None = None  # None: --max-new-tokens
    only: tuple[str, ...] | None = None  # run against the servers whose name starts with one of these only
    adapters: tuple[str | None, ...] = (None,)  # request i names adapters[i % len]: None = the base model
    stop_at_eos: bool = False  # False: EOS is banned where the server can (every answer runs to max_new)


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear interpolation; nan for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def load_tokenizer(model_dir: Path = MODEL_DIR):
    """A model directory's tokenizer (default: the default model's): the prompt sets are cut to token counts with
    it."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def build_prompt_sets(tok) -> tuple[list[str], list[str], list[int]]:
    """The varied set and a set of prompts of exactly 32 tokens (prefixes of the longer prompts)."""
    varied_lens = [len(tok.encode(p, add_special_tokens=False).ids) for p in PROMPTS]
    fixed: list[str] = []
    for p in PROMPTS:
        ids = tok.encode(p, add_special_tokens=False).ids
        if len(ids) <= PROMPT_32_TOKENS:
            continue
        for cut in (PROMPT_32_TOKENS, PROMPT_32_TOKENS + 1, PROMPT_32_TOKENS - 1):
            text = tok.decode(ids[:cut])
            if len(tok.encode(text, add_special_tokens=False).ids) == PROMPT_32_TOKENS:
                fixed.append(text)
                break
    return PROMPTS, fixed, varied_lens


def build_long_prompts(tok, n: int = 16) -> list[str]:
    """n different prompts of exactly LONG_PROMPT_TOKENS tokens: the varied prompts joined, from n starts."""
    out = []
    for start in range(n):
        ids: list[int] = []
        i = start
        while len(ids) < LONG_PROMPT_TOKENS + 8:
            ids += tok.encode(PROMPTS[i % len(PROMPTS)] + "\n", add_special_tokens=False).ids
            i += 1
        for cut in range(LONG_PROMPT_TOKENS, LONG_PROMPT_TOKENS - 6, -1):
            text = tok.decode(ids[:cut])
            if len(tok.encode(text, add_special_tokens=False).ids) == LONG_PROMPT_TOKENS:
                out.append(text)
                break
    return out


def build_prefix_prompts(tok, n: int = 16) -> tuple[str, list[str]]:
    """A system prompt of exactly SYSTEM_PROMPT_TOKENS tokens (the varied prompts joined, from the last) and n
    prompts: it plus a different question of QUESTION_TOKENS tokens, each tokenizing to the system prompt's
    tokens followed by the question's."""
    ids: list[int] = []
    for p in reversed(PROMPTS):
        ids += tok.encode(p + "\n", add_special_tokens=False).ids
    system = next(text for cut in range(SYSTEM_PROMPT_TOKENS, SYSTEM_PROMPT_TOKENS - 8, -1)
                  if len(tok.encode(text := tok.decode(ids[:cut]).rstrip() + "\n", add_special_tokens=False).ids)
                  == SYSTEM_PROMPT_TOKENS)
    head = tok.encode(system, add_special_tokens=False).ids
    out = []
    for p in PROMPTS:
        words = tok.encode("Question: " + p, add_special_tokens=False).ids
        question = tok.decode(words[:QUESTION_TOKENS])
        full = tok.encode(system + question, add_special_tokens=False).ids
        if full[:len(head)] == head and len(full) == SYSTEM_PROMPT_TOKENS + QUESTION_TOKENS:
            out.append(system + question)
    return system, out[:n]


BENCH_ADAPTERS = ("lora-a", "lora-b", "lora-c", "lora-d")  # rank 8 on all seven projections, seeds 1..4


def bench_adapters(root: Path, model_dir: Path) -> dict[str, Path]:
    """Four PEFT adapters of the model (tests/support/lora_adapters.py, fixed seeds, non-zero B, deltas of 0.1
    times each weight's spread), written once under ``root``."""
    from backends.lora import BaseDims
    from backends.mindspore.families import load_model
    from tests.support.lora_adapters import make_adapter
    from tests.support.reference_numpy import RefModel

    dirs = {name: root / name for name in BENCH_ADAPTERS}
    if not all((d / "adapter_model.safetensors").exists() for d in dirs.values()):
        import numpy as np

        dims = BaseDims.of(load_model(model_dir))
        base = RefModel.from_dir(model_dir, dtype=np.float32).w
        for seed, (name, path) in enumerate(dirs.items(), 1):
            make_adapter(path, dims, seed=seed, rank=8, alpha=16, base_weights=base, strength=0.1)
    return dirs


def scenario_table(per_client: int, min_requests: int) -> dict[str, Scenario]:
    """Every scenario by name: ``per_client`` requests per client, at least ``min_requests`` per scenario."""
    return {
        "c1": Scenario("c1", 1, max(min_requests, per_client), None),
        "c8-32tok": Scenario("c8-32tok", 8, max(min_requests, 8 * per_client), PROMPT_32_TOKENS),
        "c16": Scenario("c16", 16, max(min_requests, 16 * per_client), None),
        "c16-1024": Scenario("c16-1024", 16, 16, LONG_PROMPT_TOKENS, LONG_NEW_TOKENS, only=("mindserve",)),
        # Speculative decoding (issue 25): answers that copy their prompt, each to its own end (EOS).
        "c1-quote": Scenario("c1-quote", 1, max(min_requests, len(PASSAGES) * len(QUOTE_ASKS)), QUOTE,
                             QUOTE_NEW_TOKENS, stop_at_eos=True),
        "c1-code": Scenario("c1-code", 1, max(min_requests, len(CODE_EDITS)), CODE, CODE_NEW_TOKENS,
                            stop_at_eos=True),
        "c8-prefix": Scenario("c8-prefix", 8, max(min_requests, 8 * per_client), PREFIX,
                              only=("mindserve", "llama-server")),
        # LoRA (issue 11), on mindserve-lora only; its base-only load is c1/c16 on that same server.
        "c1-lora": Scenario("c1-lora", 1, max(min_requests, per_client), None, only=("mindserve-lora",),
                            adapters=(BENCH_ADAPTERS[0],)),
        "c16-lora": Scenario("c16-lora", 16, max(min_requests, 16 * per_client), None, only=("mindserve-lora",),
                             adapters=(None, *BENCH_ADAPTERS)),
    }


@dataclass(frozen=True)
class PromptSets:
    """Each scenario's prompts and a line describing them, keyed by ``Scenario.fixed_prompt_tokens``."""

    prompts: dict[int | str | None, list[str]]
    desc: dict[int | str | None, str]
    system: str  # c8-prefix's shared system prompt

    @property
    def varied(self) -> list[str]:
        return self.prompts[None]

    @property
    def fixed32(self) -> list[str]:
        return self.prompts[PROMPT_32_TOKENS]


def build_prompts(tok, base: bool = False) -> PromptSets:
    """Every prompt set; exits if fewer than 8 prompts of a fixed length could be cut. ``base``: the quote and code
    prompts are documents a base model continues (no chat turns)."""
    varied, fixed32, varied_lens = build_prompt_sets(tok)
    if len(fixed32) < 8:
        raise SystemExit(f"only {len(fixed32)} prompts could be cut to exactly {PROMPT_32_TOKENS} tokens")
    long_prompts = build_long_prompts(tok)
    system_prompt, prefix_prompts = build_prefix_prompts(tok)
    if len(prefix_prompts) < 8:
        raise SystemExit(f"only {len(prefix_prompts)} questions keep the system prompt's tokens")
    quote, code = build_quote_prompts(base), build_code_prompts(base)
    kind = "documents (a base model's prompts)" if base else "chat requests"
    prompts = {None: varied, PROMPT_32_TOKENS: fixed32, LONG_PROMPT_TOKENS: long_prompts, PREFIX: prefix_prompts,
               QUOTE: quote, CODE: code}
    desc = {None: f"{len(varied)} varied prompts of {min(varied_lens)}-{max(varied_lens)} tokens "
                  f"(mean {statistics.mean(varied_lens):.0f})",
            PROMPT_32_TOKENS: f"{len(fixed32)} prompts of exactly {PROMPT_32_TOKENS} tokens",
            LONG_PROMPT_TOKENS: f"{len(long_prompts)} prompts of exactly {LONG_PROMPT_TOKENS} tokens",
            PREFIX: f"{len(prefix_prompts)} prompts: one {SYSTEM_PROMPT_TOKENS}-token system prompt + a "
                    f"{QUESTION_TOKENS}-token question each",
            QUOTE: f"{len(quote)} {kind} to copy one of {len(PASSAGES)} passages of 45-60 words, each "
                   f"answer to its end (EOS) or its token cap",
            CODE: f"{len(code)} {kind} to edit a source file of 16-31 lines (Python, JavaScript, Go, SQL) "
                  f"given in the prompt, each answer to its end (EOS) or its token cap"}
    return PromptSets(prompts, desc, system_prompt)


def step_figures(before: dict | None, after: dict | None, wall: float) -> dict[str, dict[str, float]] | None:
    """The engine's steps during a scenario, by kind (``Server.step_totals`` before and after it): how many, their
    mean wall time and tokens, and the share of the scenario's wall time they took (the rest: the engine idle or
    between steps)."""
    if not before or not after:
        return None
    out = {}
    for kind, (n1, s1, t1) in after.items():
        n0, s0, t0 = before.get(kind, (0.0, 0.0, 0.0))
        if n1 > n0:
            out[kind] = {"steps": n1 - n0, "mean_ms": (s1 - s0) / (n1 - n0) * 1e3,
                         "mean_tokens": (t1 - t0) / (n1 - n0), "wall_share": (s1 - s0) / wall}
    return out


async def run_scenario(server: Server, session: aiohttp.ClientSession, sc: Scenario, prompts: list[str],
                       max_new: int) -> dict:
    """``sc`` against ``server``: its clients share the request count; the figures of the scenario's table row."""
    next_index = 0
    results: list[RequestResult] = []
    texts: dict[int, str] = {}  # the first answer to each prompt (on/off comparisons of one workload)

    async def client() -> None:
        nonlocal next_index
        while next_index < sc.requests:
            i = next_index
            next_index += 1
            adapter = sc.adapters[i % len(sc.adapters)]
            extra = {"adapter": adapter} if adapter is not None else {}
            if sc.stop_at_eos:
                extra["stop_at_eos"] = True
            res = await server.request(session, prompts[i % len(prompts)], max_new, **extra)
            results.append(res)
            if res.ok:
                texts.setdefault(i % len(prompts), res.text)

    meter = CpuMeter(psutil.Process(server.proc.pid) if server.proc else None)
    server.rss.reset_window()
    steps_before = await server.step_totals(session)
    meter.start()
    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(sc.concurrency)))
    wall = time.perf_counter() - t0
    cpu = meter.stop()
    steps = step_figures(steps_before, await server.step_totals(session), wall)
    ok = [r for r in results if r.ok]
    tokens = sum(r.tokens for r in ok)
    ttft = [r.first_token - r.start for r in ok if r.first_token is not None]
    itl = [g for r in ok for g in r.itl]
    e2e = [r.end - r.start for r in ok if r.end is not None]
    # The most requests that were generating tokens at the same moment (1 = one at a time).
    edges = sorted([(r.first_token, 1) for r in ok if r.last_token and r.last_token > r.first_token]
                   + [(r.last_token, -1) for r in ok if r.last_token and r.last_token > r.first_token],
                   key=lambda e: (e[0], e[1]))
    live = most = 0
    for _, d in edges:
        live += d
        most = max(most, live)
    errors = sorted({r.error for r in results if not r.ok and r.error})
    return {
        "scenario": sc.name, "server": server.name, "concurrency": sc.concurrency, "requests": sc.requests,
        "completed": len(ok), "failed": len(results) - len(ok), "errors": errors[:3],
        "wall_s": wall, "tokens": tokens, "tok_per_s": tokens / wall if wall > 0 else math.nan,
        "tokens_per_request": tokens / len(ok) if ok else math.nan,
        "stopped_early": sum(1 for r in ok if r.tokens < max_new),
        "ttft_p50_ms": pct(ttft, 50) * 1e3, "ttft_p95_ms": pct(ttft, 95) * 1e3,
        "itl_p50_ms": pct(itl, 50) * 1e3, "itl_p95_ms": pct(itl, 95) * 1e3,
        "e2e_p50_s": pct(e2e, 50), "max_streams_generating": most,
        "peak_rss_mib": server.rss.window_peak / 2**20, **cpu, **({"steps": steps} if steps else {}),
        "texts": [texts.get(i) for i in range(len(prompts))],
    }
