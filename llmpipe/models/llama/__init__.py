from llmpipe.models.llama.flavors import FLAVORS, model_args
from llmpipe.models.llama.model import ModelArgs, Transformer

__all__ = ["FLAVORS", "ModelArgs", "Transformer", "model_args"]
