"""Text in and out of token ids: the GGUF vocabulary's tokenizer (llama.cpp's rules), BPE merges, chat templates."""
