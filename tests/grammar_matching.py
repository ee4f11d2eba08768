"""Whether the engine's grammar matcher takes a sequence of tokens: texts are encoded, ints are token ids."""

from pathlib import Path

from pdserve.engine.grammar import GrammarCompiler
from pdserve.text.grammars import GrammarError
from pdserve.text.tokenizer import PromptTokenizer
from pdserve.wire.sampling import Grammar


def grammar_takes(model_dir: str, tokenizer: PromptTokenizer, grammar: Grammar, parts: list[str | int]) -> bool:
    ids = [t for part in parts for t in ([part] if isinstance(part, int) else tokenizer.encode(part, False))]
    eos = tokenizer.tokenizer.token_to_id(tokenizer.eos_token)
    compiler = GrammarCompiler(Path(model_dir) / "tokenizer.json", tokenizer.vocab_size, [eos])
    try:
        compiler.matcher(grammar, ids)
    except GrammarError:
        return False
    return True
