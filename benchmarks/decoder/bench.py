"""Decoders on one GPU: plain Keras, kvram and PyTorch, in one run.

TensorFlow: KerasHub's `GPT2Backbone` / `LlamaBackbone` built from a config (nothing
downloaded) with its tied `ReversibleEmbedding` head, as `GPT2CausalLM` / `LlamaCausalLM`
compute it. PyTorch: `transformers`' `GPT2LMHeadModel` / `LlamaForCausalLM` of the same
config, SDPA attention, fused AdamW. Both: bf16 (mixed_bfloat16, autocast), AdamW (lr
1e-4), one synthetic batch of token ids; MFU counts a tied head once. The shapes, the
configurations and how to run them: README.md."""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from benchmarks.common import add_xla_flags, set_kvram_switches, timed_fit, timed_torch_steps, training_main  # noqa: E402

SHAPES = {
    "gpt2": dict(vocabulary_size=50257, num_layers=24, num_heads=16, hidden_dim=1024, intermediate_dim=4096,
                 dropout=0.1),
    "llama": dict(vocabulary_size=128256, num_layers=16, num_query_heads=32, num_key_value_heads=8, hidden_dim=2048,
                  intermediate_dim=8192, tie_word_embeddings=True),
}

# name: (framework, label, settings)
CONFIGS = {
    "keras_bf16": ("tf", "plain Keras: KerasHub backbone and tied head, mixed_bfloat16, XLA", dict(plain=True)),
    "kvram_fast": ("tf", "kvram.Model, efficient_attention (cuDNN), lean_activations, fused_cross_entropy",
                   dict(attention=True, lean=True, fused=True)),
    "kvram_lean": ("tf", "kvram, the same with a Checkpoint on every decoder block",
                   dict(attention=True, lean=True, fused=True, checkpoint=True)),
    "torch_compile": ("torch", "PyTorch torch.compile(transformers model), bf16 autocast, SDPA, fused AdamW",
                      dict(compile=True)),
    "torch_compile_ckpt": ("torch", "PyTorch, the same with gradient checkpointing per block",
                           dict(compile=True, checkpoint=True)),
}


def _shape(args) -> dict:
    shape = dict(SHAPES[args.model], num_layers=args.layers or SHAPES[args.model]["num_layers"])
    if args.model == "gpt2":
        shape["max_sequence_length"] = max(args.sequence, 1024)
    return shape


def build(settings, args):
    """The model (compiled) and data of a TensorFlow configuration."""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    set_kvram_switches(settings)  # before import kvram: what it does by default, for kvram's configurations
    import keras
    import keras_hub
    import numpy as np
    import tensorflow as tf

    import kvram
    from kvram import remat

    kvram.precision.enable("mixed_bfloat16")
    if settings.get("plain"):  # Keras's own einsum, not the one `import kvram` installs
        kvram.speed.tensordot_einsum(enable=False)
    keras.utils.set_random_seed(0)
    shape = _shape(args)
    backbone = (keras_hub.models.GPT2Backbone if args.model == "gpt2" else keras_hub.models.LlamaBackbone)(**shape)
    # What GPT2CausalLM / LlamaCausalLM compute (the tied head), as one
    # functional graph of the backbone's layers, which remat.segments can cut
    logits = backbone.token_embedding(backbone.output, reverse=True)
    model = keras.Model(backbone.input, logits, name=f"{args.model}_causal_lm")
    rng = np.random.default_rng(0)
    batch, sequence = args.batch, args.sequence
    x = {"token_ids": tf.constant(rng.integers(0, shape["vocabulary_size"], (batch, sequence)), tf.int32),
         "padding_mask": tf.ones((batch, sequence), tf.int32)}
    y = tf.constant(rng.integers(0, shape["vocabulary_size"], (batch, sequence)), tf.int32)
    if settings.get("attention"):
        kvram.speed.efficient_attention(model, chunk_size=sequence)
    if settings.get("lean"):
        kvram.speed.lean_activations(model)
    if settings.get("checkpoint"):
        chain = remat.segments(model)
        blocks = [any(n.startswith("transformer_layer") for n in s.layers) for s in chain]
        model = remat.rebuild(model, [[i] for i in range(len(chain))], blocks)
    elif not settings.get("plain"):
        model = kvram.Model(model.input, model.output, name=model.name)
    model.compile(optimizer=keras.optimizers.AdamW(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=True)
    if settings.get("fused"):
        kvram.speed.fused_cross_entropy(model)
    return model, tf.data.Dataset.from_tensors((x, y)).repeat()


def _measured(tokens_per_s, parameters, args) -> dict:
    """tokens/s with the model FLOPs utilisation it is (the module docstring's formula)."""
    shape = _shape(args)
    flops = 6 * parameters + 12 * shape["num_layers"] * shape["hidden_dim"] * args.sequence
    return {"tokens_per_s": tokens_per_s, "parameters": parameters, "flops_per_token": flops,
            "mfu": tokens_per_s * flops / (args.peak_tflops * 1e12)}


def run_tf(settings, args):
    add_xla_flags(settings)  # before XLA's first compilation
    model, data = build(settings, args)
    timed = timed_fit(model, data, args.steps, args.warmup, [args.device])
    tokens_per_s = args.batch * args.sequence * timed["steps"] / timed["seconds"]
    return {
        **_measured(tokens_per_s, model.count_params(), args),
        "peak_gib": timed["peak_gib"][args.device],
        "final_loss": timed["loss"],
        "timed_steps": timed["steps"],
        "steps_per_execution": int(model.steps_per_execution or 1),
    }


def torch_step(settings, args):
    """(step, model) of a PyTorch configuration; `step()` trains one batch and returns its loss."""
    import torch
    import transformers

    cuda = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    shape = _shape(args)
    if args.model == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=shape["vocabulary_size"], n_positions=shape["max_sequence_length"], n_embd=shape["hidden_dim"],
            n_layer=shape["num_layers"], n_head=shape["num_heads"], n_inner=shape["intermediate_dim"],
            resid_pdrop=shape["dropout"], embd_pdrop=shape["dropout"], attn_pdrop=shape["dropout"],
            tie_word_embeddings=True,
        )
        cls = transformers.GPT2LMHeadModel
    else:
        config = transformers.LlamaConfig(
            vocab_size=shape["vocabulary_size"], hidden_size=shape["hidden_dim"],
            intermediate_size=shape["intermediate_dim"], num_hidden_layers=shape["num_layers"],
            num_attention_heads=shape["num_query_heads"], num_key_value_heads=shape["num_key_value_heads"],
            max_position_embeddings=max(args.sequence, 2048), tie_word_embeddings=True,
        )
        cls = transformers.LlamaForCausalLM
    model = cls._from_config(config, attn_implementation="sdpa").to(cuda)
    model.train()
    if settings.get("checkpoint"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda == "cuda")
    compiled = torch.compile(model) if settings.get("compile") else model
    x = torch.randint(0, shape["vocabulary_size"], (args.batch, args.sequence), device=cuda)
    y = torch.randint(0, shape["vocabulary_size"], (args.batch, args.sequence), device=cuda)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(cuda, dtype=torch.bfloat16):
            loss = compiled(input_ids=x, labels=y).loss
        loss.backward()
        opt.step()
        return loss

    return step, model


def run_torch(settings, args):
    step, model = torch_step(settings, args)
    timed = timed_torch_steps(step, args.steps, args.warmup)
    tokens_per_s = args.batch * args.sequence * args.steps / timed["seconds"]
    return {
        **_measured(tokens_per_s, sum(p.numel() for p in model.parameters()), args),
        "peak_gib": timed["peak_gib"],
        "final_loss": timed["loss"],
        "first_step_s": timed["first_step_s"],
    }


def _arguments(parser):
    parser.add_argument("--sequence", type=int, default=1024, help="tokens per row")
    parser.add_argument("--model", choices=sorted(SHAPES), default="gpt2", help="the decoder's shape")
    parser.add_argument("--layers", type=int, default=None, help="decoder blocks (default: the shape's; fewer: a smoke run)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 TFLOP/s, for MFU")


def main():
    training_main(__doc__, __file__, "decoder-train", CONFIGS, {"tf": run_tf, "torch": run_torch},
                  {"batch": 8, "steps": 32, "warmup": 16}, rate="tokens_per_s", extra_arguments=_arguments,
                  describe_run=lambda args: {"model": args.model, "shape": _shape(args), "sequence": args.sequence,
                                             "peak_tflops": args.peak_tflops})


if __name__ == "__main__":
    main()
