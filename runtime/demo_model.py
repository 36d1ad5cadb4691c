"""The built-in demo model that `kvserve serve` runs when no MODEL_DIR is given.

Built offline and deterministically, then loaded through the normal `model=DIR` path:
- a byte-level BPE tokenizer trained with the `tokenizers` library on the small corpus embedded below,
  with ChatML special tokens and a chat template;
- a small Llama-shaped config (hidden 256, 4 layers, 8 query / 4 KV heads, vocab = the tokenizer's);
- **random weights** from a fixed seed, written as safetensors. The model generates gibberish; it exists so
  the whole serving path (HTTP, batching, paged KV, metrics) runs on a fresh machine with no download.

The directory is written once to `$KVSERVE_CACHE_DIR` (default `~/.cache/kvserve`) under a name that hashes
everything that defines it, via a temporary directory and an atomic rename, so concurrent builders are safe.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEMO_MODEL_ID = "kvserve-demo-random-weights"
DEMO_FORMAT_VERSION = 2  # bump when anything below changes the files
SEED = 20240601

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_VOCAB_TARGET = 1024

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

MODEL_SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 8192,  # room for the benchmark's 4k-token prompts
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}
# Std of the random weights. Larger than a trained model's init (0.02) so the logits are peaked: greedy
# decoding then has clear winners instead of near-ties, and server and offline outputs match exactly.
WEIGHT_STD = 0.25

# Original text written for this module (no third-party content). Only the tokenizer learns from it.
CORPUS = """\
The harbour town woke slowly. Fishing boats came in with the tide, gulls circled over the market, and the
baker opened his shutters to let the smell of warm bread drift down to the water. Children ran along the
sea wall, counting the boats and shouting the names painted on their sides.
A small robot lived in the lighthouse at the end of the pier. Every evening it climbed the spiral stairs,
wiped the great lens with a soft cloth, and switched on the light. It liked the quiet hours best, when the
only sounds were the waves below and the wind turning the weather vane above.
One morning the robot found a letter tucked under the door. The letter said: "Please teach me how the light
works. I want to keep a lighthouse too, one day." It was signed by a girl named Mira who lived above the
bakery. The robot read the letter three times, then folded it carefully and put it in its chest drawer.
That afternoon Mira came to the pier. The robot showed her the switches, the gears and the oil cans, and
explained why the lens had so many rings of glass. "Each ring bends the light a little," it said, "so that
all of it leaves the tower in one bright beam that ships can see from far away."
Servers answer requests. A request arrives with a prompt, waits in a queue, is scheduled when there is room,
and produces tokens one at a time until it reaches a stop condition. A good server keeps every request
moving, shares memory between requests that begin the same way, and reports how busy it is so that more
copies can be started when the queue grows long.
Memory is divided into blocks of equal size. Each sequence owns a list of blocks, and a table maps the
position of every token to the block that holds its keys and values. When a sequence finishes, its blocks
return to the free list, and the next request can use them at once.
The garden behind the school had six raised beds. In spring the students planted beans, peas, lettuce,
carrots, onions and a row of sunflowers that grew taller than the teacher. They measured the sunflowers
every Friday and wrote the numbers on a chart by the door: ten, twenty, thirty five, fifty, seventy two.
Rain fell for most of April. The students learned that snails love wet nights and young lettuce, so they
built small fences from copper tape and checked the beds every morning before class. By May the lettuce
was safe, the peas were climbing their strings, and the first bean flowers had opened, white and purple.
Numbers have their own rhythm: one, two, three, four, five, six, seven, eight, nine, ten. Eleven, twelve,
thirteen. Twenty, thirty, forty, fifty, sixty, seventy, eighty, ninety, one hundred, one thousand.
Questions and answers. What is the capital of a country? It is the city where its government meets. How
many days are in a week? There are seven. Why is the sky blue? Air scatters blue light more than red light,
so the sky looks blue on a clear day. What do plants need to grow? Light, water, air and good soil.
The old clock in the station had stopped at a quarter past nine. Nobody knew how long it had been that
way, because the trains kept their own time and the travellers all carried phones. A watchmaker passing
through looked up at it, set down her bag, and asked the station master for a ladder.
She opened the clock face and found a small nest behind the hands, built from straw, string and a bus
ticket dated many years ago. The birds had long since flown. She moved the nest to a shelf, oiled the
wheels, wound the spring, and the clock began to tick again, loud enough to hear across the platform.
Hello! How are you today? I am well, thank you. Can you help me with a question? Of course, what would you
like to know? I would like to write a short story about a dragon who is afraid of the dark. That sounds
lovely. Let us begin: once upon a time, in a cave high on a mountain, there lived a small green dragon.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))
{"name": "kvserve", "version": 1, "ready": true, "blocks": [0, 1, 2, 3]}
"""


def default_cache_dir() -> Path:
    root = os.environ.get("KVSERVE_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "kvserve" if xdg else Path.home() / ".cache" / "kvserve"


def _spec_hash() -> str:
    spec = json.dumps(
        {
            "v": DEMO_FORMAT_VERSION,
            "seed": SEED,
            "shape": MODEL_SHAPE,
            "std": WEIGHT_STD,
            "corpus": CORPUS,
            "special": SPECIAL_TOKENS,
            "vocab": TOKENIZER_VOCAB_TARGET,
            "template": CHAT_TEMPLATE,
        },
        sort_keys=True,
    )
    return hashlib.sha256(spec.encode()).hexdigest()[:12]


def demo_model_dir(cache_dir: str | Path | None = None) -> Path:
    return Path(cache_dir or default_cache_dir()) / f"demo-{_spec_hash()}"


def _build_tokenizer(out_dir: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_TARGET,
        min_frequency=2,
        show_progress=False,
        special_tokens=SPECIAL_TOKENS,  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no unknown tokens
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "add_bos_token": False,
                "add_eos_token": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": MODEL_SHAPE["max_position_embeddings"],
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2)
    )
    return tokenizer.get_vocab_size()


def _build_weights(out_dir: Path, vocab_size: int) -> None:
    import torch
    from safetensors.torch import save_file

    s = MODEL_SHAPE
    hidden, inter = s["hidden_size"], s["intermediate_size"]
    head_dim = hidden // s["num_attention_heads"]
    kv_dim = head_dim * s["num_key_value_heads"]
    gen = torch.Generator().manual_seed(SEED)

    def rand(*shape: int, fan_in: int | None = None) -> torch.Tensor:
        # std scaled by 1/sqrt(fan_in / hidden) keeps activations in range for the wider down_proj input
        std = WEIGHT_STD * (hidden / fan_in) ** 0.5 if fan_in else WEIGHT_STD
        return (torch.randn(*shape, generator=gen) * std).contiguous()

    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(vocab_size, hidden)}
    for i in range(s["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = rand(hidden, hidden)
        tensors[p + "self_attn.k_proj.weight"] = rand(kv_dim, hidden)
        tensors[p + "self_attn.v_proj.weight"] = rand(kv_dim, hidden)
        tensors[p + "self_attn.o_proj.weight"] = rand(hidden, hidden)
        tensors[p + "mlp.gate_proj.weight"] = rand(inter, hidden)
        tensors[p + "mlp.up_proj.weight"] = rand(inter, hidden)
        tensors[p + "mlp.down_proj.weight"] = rand(hidden, inter, fan_in=inter)
        tensors[p + "input_layernorm.weight"] = torch.ones(hidden)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    tensors["model.norm.weight"] = torch.ones(hidden)
    # One metadata key only: safetensors writes metadata from a hash map, so several keys come out in a
    # random order and the file bytes would differ between builds.
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def _write_configs(out_dir: Path, vocab_size: int) -> None:
    s = MODEL_SHAPE
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": s["hidden_size"],
        "intermediate_size": s["intermediate_size"],
        "num_hidden_layers": s["num_hidden_layers"],
        "num_attention_heads": s["num_attention_heads"],
        "num_key_value_heads": s["num_key_value_heads"],
        "head_dim": s["hidden_size"] // s["num_attention_heads"],
        "max_position_embeddings": s["max_position_embeddings"],
        "rope_theta": s["rope_theta"],
        "rms_norm_eps": s["rms_norm_eps"],
        "tie_word_embeddings": s["tie_word_embeddings"],
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "float32",
        "kvserve_demo_random_weights": True,
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}, indent=2))
    (out_dir / "README.md").write_text(
        f"# {DEMO_MODEL_ID}\n\nBuilt by kvserve.runtime.demo_model. RANDOM WEIGHTS (seed {SEED}): the output is "
        "gibberish. It exists to exercise the serving path offline.\n"
    )


def ensure_demo_model(cache_dir: str | Path | None = None) -> Path:
    """Return the demo model directory, building it first if this machine has none."""
    target = demo_model_dir(cache_dir)
    if (target / "config.json").exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        if cache_dir is not None:
            raise
        # read-only home (some containers): build under the temp dir instead
        target = demo_model_dir(Path(tempfile.gettempdir()) / "kvserve")
        if (target / "config.json").exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-build-", dir=target.parent))
    os.chmod(tmp, 0o755)
    try:
        vocab_size = _build_tokenizer(tmp)
        _build_weights(tmp, vocab_size)
        _write_configs(tmp, vocab_size)  # config.json last: its presence marks a complete directory
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").exists():  # a concurrent builder won unless it failed too
                raise
        logger.info("built demo model (random weights) at %s", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def is_demo_model_dir(model_dir: str | Path) -> bool:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(config.get("kvserve_demo_random_weights"))
