"""Loading real weights and tokenizers.

  jhybrid.loading.params      build_model: fill an abstract CausalLM from named tensors, checked
  jhybrid.loading.hf          Hugging Face folders (config.json + safetensors, sharded index)
"""
