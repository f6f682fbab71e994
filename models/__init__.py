"""Pretrained base models for `01_bc.py --model PATH`, built from packages installed with pip
(nothing is downloaded from a model hub): tiny.py, the tiny model 00_pretrain.py and
`01_bc.py --model tiny` build; smollm2.py, one command that writes SmolLM2 as a local Hugging Face
model directory (docs/real_model.md)."""
