"""Retrofitting Llama checkpoints into EG-MLA: conversion, recovery fine-tuning and evaluation."""

from .convert import (
    calibrate,
    convert_llama_to_egmla,
    kv_lora_rank_for_cut,
    load_llama,
    load_tokenizer,
)

__all__ = ["calibrate", "convert_llama_to_egmla", "kv_lora_rank_for_cut", "load_llama", "load_tokenizer"]
