"""The tiny model of the miniature: a byte-level BPE tokenizer trained on the episodes' text, and a
small Llama for it. 00_pretrain.py builds the base language model with these; 01_bc.py with
`--model tiny` starts from scratch with them. A pretrained model (models/smollm2.py, or any local
Hugging Face directory) brings its own tokenizer and chat template instead."""
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL = {"pad": "<|pad|>", "end": "<|end|>", "system": "<|system|>", "user": "<|user|>",
           "assistant": "<|assistant|>"}


# A chat template without whitespace between turns: each turn is <|role|>content<|end|>,
# so the action tokens of turn t are its content tokens plus <|end|>, and the state
# position s_t is the <|assistant|> token of the generation prompt.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train_tiny_tokenizer(texts, vocab_size):
    """Byte-level BPE on `texts` (message contents; pass a repeated instruction once, so it
    does not dominate the merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL["end"], pad_token=SPECIAL["pad"],
                                   padding_side="left", chat_template=TINY_CHAT_TEMPLATE)


def build_tiny_model(tokenizer, args):
    """A small Llama for this tokenizer (args: d_model, n_layers, n_heads, max_len), its input and
    output embeddings tied."""
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=args.d_model, intermediate_size=4 * args.d_model,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads, num_key_value_heads=args.n_heads,
        max_position_embeddings=args.max_len, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)
