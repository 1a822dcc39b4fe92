"""Past one device: the tensor-parallel mesh and shardings, multi-host leader/follower, and
loading params (Hugging Face or Orbax) straight onto their shards."""
