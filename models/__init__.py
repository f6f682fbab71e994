"""Pretrained base models for `01_bc.py --model PATH`, built from packages installed with pip
(nothing is downloaded from a model hub). Each module here is one command that writes a local
Hugging Face model directory; see README, "A real language model"."""
