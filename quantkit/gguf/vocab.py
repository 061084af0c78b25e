"""Tokenizer -> GGUF vocabulary, as convert_hf_to_gguf.py writes it (llama.cpp 0c1e570).

Each architecture's converter class picks its tokenizer path (its `set_vocab`); VOCAB_KINDS
below names them and `add_vocab(writer, model_dir, hparams, kind)` follows the same order:

  * "llama" (LlamaModel: Llama, Mistral, Mixtral): tokenizer.model through sentencepiece, else BPE
    (the converter tries gguf.LlamaHfVocab first, see add_llama_family_vocab); add_space_prefix
    from tokenizer_config.json's add_prefix_space;
  * "qwen2" (Qwen2 / Qwen3 / Qwen3-MoE): tokenizer.model if present, else BPE;
  * "gpt2" (TextModel's own set_vocab, the families that do not override it): BPE from tokenizer.json;
  * "gemma" / "gemma2": tokenizer.model (add_space_prefix false; Gemma 1 adds CodeGemma ids);
  * "gemma3": tokenizer.model (add_space_prefix false) if present, else BPE;
  * "phi3": BPE when tokenizer_config.json says GPT2Tokenizer (Phi-4), else Phi3MiniModel's own
    SentencePiece reading (added tokens from tokenizer_config.json and tokenizer.json);
  * "ernie4_5" (Ernie4_5Model): tokenizer.model alone, add_space_prefix from tokenizer_config.json;
  * "hunyuan" (HunYuanModel): BPE from tokenizer.json, eos from eod_token_id, eot from generation_config.json;
  * "glm" (TextModel._set_vocab_glm: GLM-4.5/4.6's Glm4MoeModel): BPE from tokenizer.json, then bos [gMASK],
    eot <|user|>, unk <|endoftext|>, eom <|observation|> where SpecialVocab has none of that kind yet;
  * "gemma4" (Gemma4Model): tokenizer.json through gguf-py's LlamaHfVocab under llama.cpp's "gemma4"
    tokenizer (add_space_prefix false, BOS always added; the chat-channel tokens USER_DEFINED).

SentencePiece vocabularies carry the model's scores and types (UNKNOWN/CONTROL/UNUSED/BYTE/
NORMAL), ids up to the config's vocab_size padded with "[PAD{i}]" (score -10000, UNUSED), added
tokens scored -1000 and typed CONTROL/USER_DEFINED: llama.cpp's SentencePiece tokenizer works
from those scores, so they are written exactly as the converter writes them.
BPE vocabularies are what transformers' AutoTokenizer gives the converter (added tokens that are
not normalized are encoded and decoded once; special ones CONTROL, others USER_DEFINED), read
through the tokenizers library alone where that is the same tokenizer (BPETokenizer).
Special ids, add_bos/add_eos, merges and the chat template come from `SpecialVocab`, gguf-py's
class with the newer rules of llama.cpp's own copy (post-processor flags win over
tokenizer_config.json; normalizer flags), see quantkit.gguf.special_vocab.

Pre-tokenizer name: convert_hf_to_gguf.py hashes the token ids of a fixed check text (CHKTXT)
and looks the hash up in a table generated from known models (KNOWN_PRE_HASHES below, copied
from llama.cpp's conversion/base.py). An unknown hash makes llama.cpp's converter refuse;
quantkit instead reads the tokenizer's structure (quantkit.gguf.pretokenizer) and writes the
llama.cpp pre-tokenizer that splits every text as the tokenizer does: "gpt-2", "llama-bpe" or
"qwen2" for byte-level BPE, llama.cpp's SentencePiece-style BPE pre-tokenizer for a
SentencePiece-style tokenizer.json (add_spm_style_vocab). Anything else is refused (exit 2).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from hashlib import sha256
from pathlib import Path

from quantkit.errors import InputError, UnsupportedError
from quantkit.gguf import pretokenizer

KNOWN_PRE_HASHES: dict[str, str] = {
    "b6e8e1518dc4305be2fe39c313ed643381c4da5db34a98f6a04c093f8afbe99b": "chatglm-bpe",
    "81d72c7348a9f0ebe86f23298d37debe0a5e71149e29bd283904c02262b27516": "chatglm-bpe",
    "a1336059768a55c99a734006ffb02203cd450fed003e9a71886c88acf24fdbc2": "glm4",
    "9ca2dd618e8afaf09731a7cf6e2105b373ba6a1821559f258b272fe83e6eb902": "glm4",
    "cdf5f35325780597efd76153d4d1c16778f766173908894c04afc20108536267": "glm4",
    "1431a23e583c97432bc230bff598d103ddb5a1f89960c8f1d1051aaa944d0b35": "minerva-7b",
    "7e57df22b1fe23a7b1e1c7f3dc4e3f96d43a4eb0836d0c6bdc3436d7b2f1c664": "hunyuan",
    "bba3b3366b646dbdded5dbc42d59598b849371afc42f7beafa914afaa5b70aa6": "hunyuan-dense",
    "e6ddf9c6686791c12d698d34c31ab9be1fea9af5a3d9a6909783ab382198ae1c": "hy_v4",
    "a6b57017d60e6edb4d88ecc2845188e0eb333a70357e45dcc9b53964a73bbae6": "falcon-h1",
    "60476e1243776c4fb1b993dbd7a5f15ac22f83c80afdf425fa5ae01c8d44ef86": "falcon-h1",
    "3eda48b4c4dc7de733d1a8b3e3b4a85243dbbf704da2ee9d42c6beced8897896": "falcon-h1",
    "48f8e02c0359c0bbdd82f26909171fac1c18a457bb47573ed1fe3bbb2c1cfd4b": "falcon-h1",
    "81212dc7cdb7e0c1074ca62c5aeab0d43c9f52b8a737be7b12a777c953027890": "kimi-k2",
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",
    "1444df51289cfa8063b96f0e62b1125440111bc79a52003ea14b6eac7016fd5f": "qwen35",
    "66b8d4e19ab16c3bfd89bce5d785fb7e0155e8648708a1f42077cb9fe002c273": "grok-2",
    "b3d1dd861f1d4c5c0d2569ce36baf3f90fe8a102db3de50dd71ff860d91be3df": "jina-v2-de",
    "0fe1cf6eda062318a1af7270f3331a85c539a01778ff948e24388e949c5282f4": "gpt-2",
    "9e454714343b69b99b71795c1d27a68c2a1d15dab111f4d353109f966af29da7": "lfm2",
    "846deafc5b0fa786186fa4ae6c7b49903cf2f1d1895bdb80b9120d60be135252": "gemma4",
    "0a766d034107bc736a3f2dc4968fd62e54a3570f1454443e0c5a4cc6bd7941ed": "spark2_5",
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",
    "049ecf7629871e3041641907f3de7c733e4dbfdc736f57d882ba0b0845599754": "deepseek-llm",
    "347715f544604f9118bb75ed199f68779f423cabb20db6de6f31b908d04d7821": "deepseek-coder",
    "8aeee3860c56296a157a1fe2fad249ec40aa59b1bb5709f4ade11c4e6fe652ed": "falcon",
    "0876d13b50744004aa9aeae05e7b0647eac9d801b5ba4668afc01e709c15e19f": "bert-bge",
    "9d032fcbd5501f4a38150912590928bfb36091efb5df11b8e2124b0390e3fb1e": "falcon3",
    "8e62295832751ca1e8f92f2226f403dea30dc5165e448b5bfa05af5340c64ec7": "bert-bge-large",
    "b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166": "mpt",
    "35d91631860c815f952d711435f48d356ebac988362536bed955d43bfa436e34": "starcoder",
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
    "32d85c31273f8019248f2559fed492d929ea28b17e51d81d3bb36fff23ca72b3": "stablelm2",
    "6221ad2852e85ce96f791f476e0b390cf9b474c9e3d1362f53a24a06dc8220ff": "refact",
    "9c2227e4dd922002fb81bde4fc02b0483ca4f12911410dee2255e4987644e3f8": "command-r",
    "d772b220ace2baec124bed8cfafce0ead7d6c38a4b65ef11261cf9d5d62246d1": "tiny_aya",
    "52df12b4c8d4176e7481aab4b6e8454d1fd0a210a04a574f6d4e067d10e23c3e": "cohere2moe",
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",
    "a8594e3edff7c29c003940395316294b2c623e09894deebbc65f33f1515df79e": "dbrx",
    "c7699093ba4255a91e702aa38a596aa81669f3525dae06c2953267dde580f448": "jina-v1-en",
    "171aeeedd6fb548d418a7461d053f11b6f1f1fc9b387bd66640d28a4b9f5c643": "jina-v2-es",
    "27949a2493fc4a9f53f5b9b029c82689cfbe5d3a1929bb25e043089e28466de6": "jina-v2-de",
    "a023e9fdc5a11f034d3ef515b92350e56fb2af1f66c6b6811a4444ea9bf8763d": "jina-v5-nano",
    "c136ed14d01c2745d4f60a9596ae66800e2b61fa45643e72436041855ad4089d": "smaug-bpe",
    "c7ea5862a53e4272c035c8238367063e2b270d51faa48c0f09e9d5b54746c360": "poro-chat",
    "7967bfa498ade6b757b064f31e964dddbb80f8f9a4d68d4ba7998fcf281c531a": "jina-v2-code",
    "7fc505bd3104ca1083b150b17d088b59534ede9bde81f0dd2090967d7fe52cee": "viking",
    "b53802fb28e26d645c3a310b34bfe07da813026ec7c7716883404d5e0f8b1901": "jais",
    "bc5108ee1eb6a3d600cadd065f63190fbd0554dbc9e4bbd6a0d977970afc8d2a": "jais-2",
    "7b3e7548e4308f52a76e8229e4e6cc831195d0d1df43aed21ac6c93da05fec5f": "codeshell",
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",
    "3c30d3ad1d6b64202cd222813e7736c2db6e1bd6d67197090fc1211fbc612ae7": "bloom",
    "bc01ce58980e1db43859146dc51b1758b3b88729b217a74792e9f8d43e479d21": "gpt3-finnish",
    "4e2b24cc4770243d65a2c9ec19770a72f08cffc161adbb73fcbb6b7dd45a0aae": "exaone",
    "fcace8b9cac38ce847670c970cd5892031a753a1ef381abd1d9af00f713da085": "phi-2",
    "60824e3c0d9401f89943cbb2fff727f0e2d4c545ba4df2d6e4f09a6db0f5b450": "chameleon",
    "8b5a93ed704057481f240da0be7e7dca721d7f8f4755263b6807227a2cbeae65": "roberta-bpe",
    "ad851be1dba641f2e3711822f816db2c265f788b37c63b4e1aeacb9ee92de8eb": "gigachat",
    "d4c8f286ea6b520b3d495c4455483cfa2302c0cfcd4be05d781b6a8a0a7cdaf1": "megrez",
    "877081d19cf6996e2c4ff0e1236341e9b7bde288f5311a56a937f0afbbb3aeb5": "deepseek-v3",
    "b3f499bb4255f8ca19fccd664443283318f2fd2414d5e0b040fbdd0cc195d6c5": "deepseek-r1-qwen",
    "ccc2ef013c104be7bae2965776d611e1d7a8a2a9c547dd93a682c9a9fc80352e": "gpt-4o",
    "7dec86086fcc38b66b7bc1575a160ae21cf705be7718b9d5598190d7c12db76f": "superbpe",
    "1994ffd01900cfb37395608534236ecd63f2bd5995d6cb1004dda1af50240f15": "trillion",
    "96a5f08be6259352137b512d4157e333e21df7edd3fcd152990608735a65b224": "bailingmoe",
    "d353350c764d8c3b39c763113960e4fb4919bea5fbf208a0e3b22e8469dc7406": "llama4",
    "0e9433cbbb161f89e264eb32e8e64bfe69e834973ffca5d41d3948a604a3e2a3": "pixtral",
    "d5f1dd6f980fec569fb218a81a7658ac45fc56b38c5a0adeb1c232fbe04ef5ec": "seed-coder",
    "b0a6b1c0bd5998ebd9df08611efde34a4ff03faed45ae09c43e6b31ebd4b94cf": "a.x-4.0",
    "f6791d196f87ce6b56a7d234be618e0d58f8cda3549416635b2bebcd22cd95c4": "midm-2.0",
    "169bf0296a13c4d9b7672313f749eb36501d931022de052aad6e36f2bf34dd51": "lfm2",
    "2085e1638f6c377a0aa4ead21b27bb4cb941bf800df86ed391011769c1758dfb": "exaone4",
    "a1e163ecab2e718a4c829d1148b6e86824ec36163bb71941c3dca9cd5ac25756": "mellum",
    "a0b64b4385f123663873756336c085744376d015ff328bb1d901598f63c44152": "modern-bert",
    "49fc0303c9e0d2c2c565c510f64b2d9b271276acdcdadff733249eda9f7d59df": "afmoe",
    "9b1be57e70d20d9501b2b3186e792d81181ae36ada3903c26f9fea418cf87206": "bailingmoe2",
    "53e325976a6e142379c19b09afcae354f2f496f147afa8f9e189a33fe4e3024e": "granite-docling",
    "f4f37b6c8eb9ea29b3eac6bb8c8487c5ab7885f8d8022e67edc1c68ce8403e95": "minimax-m2",
    "4a2e2abae11ca2b86d570fc5b44be4d5eb5e72cc8f22dd136a94b37da83ab665": "kormo",
    "9d70134b369a70e5735009b6de918f7581b5211f7c074d1f89f753aea8248af1": "youtu",
    "16389f0a1f51ee53e562ffd51c371dc508639ab0e4261502071836e50e223e91": "solar-open",
    "6c81ce329e0802883b22eabab0d3fa48357337ef1ecb45443828bf1f6254833f": "exaone-moe",
    "d30d75d9059f1aa2c19359de71047b3ae408c70875e8a3ccf8c5fba56c9d8af4": "qwen35",
    "b4b8ca1f9769494fbd956ebc4c249de6131fb277a4a3345a7a92c7dd7a55808d": "joyai-llm",
    "e4d54df1ebc1f2b91acd986c5b51aa50837d5faf7c7398e73c1f9e9ee5d19869": "kanana2",
    "862f827721df956049dff5ca81a57f29e575280bc622e290d3bf4e35eca29015": "f2llmv2",
    "62f6fb0a6fd5098caeabb19b07a5c1099cafc8b9c40eab6ea89ece4ec02fbc57": "sarvam-moe",
    "f728162c1315c26e40249849799b4ba3fe584c32084b4795b03eb295e63cb5af": "talkie",
    "36f3066e97b7f3994b379aaacde306c1444c6ae84e81a5ae3cd2b7ed3b8c42d4": "minicpm5",
    "f241072145675bf8322086f115aebad05e9f869557a238bf2150a2a417d1bf60": "granite-embed-multi-97m",
    "789696f5946cc0fc59371f39f6097cafed196b3acded6140432f26bbb1ae1669": "granite-embed-multi-311m",
    "9dcf830ee9990cdbf78cc523a5f7bd9ad8f3f9890c2d3581d2785ad10f07049d": "mellum2",
    "972da7b59cec44d1f0a490a86c96df53859e486e481563e5dddac155013d87ac": "laguna",
    "653660222fb704f61cbf2b618a8ae6502b7f8b20c980f9a5de07ed78e13319cd": "ufakzeka",
}
CHKTXT = '\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на Български \'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s there, \'RE you sure? \'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL'

VOCAB_KINDS = ("llama", "qwen2", "gemma", "gemma2", "gemma3", "phi3", "gpt2", "gemma4", "ernie4_5", "hunyuan",
               "glm")
SPM_PAD_SCORE = -10000.0  # ids of the config's vocabulary that the tokenizer.model lacks
ADDED_SCORE = -1000.0
CONTROL, USER_DEFINED, UNUSED = 3, 4, 5  # gguf.TokenType values (SentencePieceTokenTypes in the converter)


@dataclass
class VocabInfo:
    """What was written, for the report."""

    model: str
    pre: str | None
    size: int
    pre_source: str = ""  # "hash", "structure", "fallback" or "spm"
    warnings: list[str] = field(default_factory=list)


def add_vocab(writer, model_dir: Path, hparams: dict, kind: str) -> VocabInfo:
    """Write the tokenizer.* keys the architecture's converter class writes."""
    model_dir = Path(model_dir)
    if kind not in VOCAB_KINDS:
        raise UnsupportedError(f"unknown vocabulary kind '{kind}'", hint="one of: " + ", ".join(VOCAB_KINDS))
    if kind == "llama":
        info = add_llama_family_vocab(writer, model_dir, hparams)
    elif kind == "gpt2":
        info = add_bpe_vocab(writer, model_dir, hparams)
    elif kind == "phi3":
        info = add_phi3_vocab(writer, model_dir, hparams)
    elif kind == "gemma4":
        info = add_gemma4_vocab(writer, model_dir)
    elif kind == "ernie4_5":
        return add_ernie_vocab(writer, model_dir, hparams)
    elif kind == "hunyuan":
        info = add_hunyuan_vocab(writer, model_dir, hparams)
    elif kind == "glm":
        info = add_bpe_vocab(writer, model_dir, hparams, special=glm_special_tokens(model_dir))
    else:
        has_spm = (model_dir / "tokenizer.model").is_file()
        info = add_sentencepiece_vocab(writer, model_dir, hparams) if has_spm else add_bpe_vocab(writer, model_dir,
                                                                                                  hparams)
        if kind == "gemma":
            add_codegemma_tokens(writer, model_dir)
        if kind in ("gemma", "gemma2") or (kind == "gemma3" and has_spm):
            writer.add_add_space_prefix(False)
    if info.pre_source == "spm":
        info.warnings += sentencepiece_warnings(model_dir, kind)
    return info


def add_ernie_vocab(writer, model_dir: Path, hparams: dict) -> VocabInfo:
    """Ernie4_5Model.set_vocab: the SentencePiece tokenizer.model (the family's vocab_check requires it), then
    add_space_prefix where tokenizer_config.json states add_prefix_space."""
    info = add_sentencepiece_vocab(writer, model_dir, hparams)
    config = read_json(model_dir / "tokenizer_config.json")
    if "add_prefix_space" in config:
        writer.add_add_space_prefix(config["add_prefix_space"])
    info.warnings += sentencepiece_warnings(model_dir, "llama")  # llama.cpp's default: a prefix space
    return info


def add_hunyuan_vocab(writer, model_dir: Path, hparams: dict) -> VocabInfo:
    """HunYuanModel.set_vocab (tokenizer.json: the family's vocab_check requires it): TextModel's BPE vocabulary
    and merges, eos <- eod_token_id, eot <- generation_config.json's first eos id where it lists two or more."""
    info = add_bpe_vocab(writer, model_dir, hparams)
    if hparams.get("eod_token_id") is not None:
        writer.add_eos_token_id(hparams["eod_token_id"])
    eos = read_json(model_dir / "generation_config.json").get("eos_token_id")
    if isinstance(eos, list) and len(eos) >= 2:
        writer.add_eot_token_id(eos[0])
    return info


# TextModel._set_vocab_glm's special tokens (kind -> the added token whose id it takes), in its order
GLM_SPECIAL_TOKENS = {"bos": "[gMASK]", "eot": "<|user|>", "unk": "<|endoftext|>", "eom": "<|observation|>"}


def glm_special_tokens(model_dir: Path) -> dict[str, int]:
    """The ids _set_vocab_glm gives SpecialVocab (each only where it has no id of that kind yet); the converter
    fails on a tokenizer lacking one of the tokens (quantkit refuses it before work: check_vocab). The added
    tokens as the converter reads them: its tokenizer's get_added_vocab()."""
    added = load_bpe_tokenizer(Path(model_dir)).get_added_vocab()
    missing = [t for t in GLM_SPECIAL_TOKENS.values() if t not in added]
    if missing:
        raise UnsupportedError(f"GGUF conversion of GLM: the tokenizer has no added token {', '.join(missing)} "
                               "(llama.cpp's converter reads GLM's special tokens [gMASK], <|user|>, <|endoftext|> "
                               "and <|observation|> from it and fails without them)",
                               hint="use the tokenizer files of the original GLM-4.5 / 4.6 checkpoint")
    return {kind: added[token] for kind, token in GLM_SPECIAL_TOKENS.items()}


def sentencepiece_warnings(model_dir: Path, kind: str) -> list[str]:
    """How llama.cpp's SentencePiece tokenizer reads the written vocabulary otherwise than transformers
    reads the checkpoint (quantkit.gguf.pretokenizer.spm_difference); [] where they agree."""
    from transformers import AutoTokenizer

    prefix = False if kind.startswith("gemma") else True  # llama.cpp's default without the key
    if kind == "llama":
        config = read_json(model_dir / "tokenizer_config.json").get("add_prefix_space")
        prefix = True if config is None else bool(config)
    backend = AutoTokenizer.from_pretrained(model_dir, local_files_only=True).backend_tokenizer
    difference = pretokenizer.spm_difference(pretokenizer.pipeline(backend), prefix)
    return [f"tokenizer.model: llama.cpp's SentencePiece tokenizer and transformers differ: {difference}"] \
        if difference else []


def uses_bpe(model_dir: Path, kind: str) -> bool:
    """Whether add_vocab reads tokenizer.json as BPE (no tokenizer.model; Phi-3: a GPT2Tokenizer)."""
    if kind == "phi3":
        return read_json(Path(model_dir) / "tokenizer_config.json").get("tokenizer_class") == "GPT2Tokenizer"
    if kind in ("gpt2", "glm"):
        return True
    if kind == "gemma4":  # gguf-py's LlamaHfVocab, whatever tokenizer.model there is
        return False
    return not (Path(model_dir) / "tokenizer.model").is_file()


def check_vocab(model_dir: Path, kind: str) -> None:
    """Before any work: the refusal add_vocab would raise for a BPE tokenizer llama.cpp reads differently."""
    if kind == "gemma4":
        check_gemma4_vocab(Path(model_dir))
    if kind == "glm":
        glm_special_tokens(Path(model_dir))
    if kind in VOCAB_KINDS and uses_bpe(model_dir, kind):
        bpe_pre_name(load_bpe_tokenizer(Path(model_dir)), Path(model_dir))


def add_llama_family_vocab(writer, model_dir: Path, hparams: dict) -> VocabInfo:
    """LlamaModel.set_vocab: sentencepiece, else BPE; CodeLlama / Granite extras.

    (LlamaModel.set_vocab tries gguf-py's LlamaHfVocab before BPE: a SentencePiece vocabulary with
    every score -1000, which llama.cpp's SentencePiece tokenizer then merges leftmost-first instead
    of by the merges' ranks. quantkit reads such a tokenizer.json as SentencePiece-style BPE instead,
    see quantkit.gguf.pretokenizer.)"""
    import gguf

    config = read_json(model_dir / "tokenizer_config.json")
    if config.get("add_prefix_space") is not None:
        writer.add_add_space_prefix(config["add_prefix_space"])
    if (model_dir / "tokenizer.model").is_file():
        info = add_sentencepiece_vocab(writer, model_dir, hparams)
    else:
        info = add_bpe_vocab(writer, model_dir, hparams)
    if hparams.get("vocab_size", 32000) == 32016:  # CodeLlama infill tokens
        special = gguf.SpecialVocab(model_dir, load_merges=False,
                                    special_token_types=["prefix", "suffix", "middle", "eot"])
        for kind, tid in (("prefix", 32007), ("suffix", 32008), ("middle", 32009), ("eot", 32010)):
            special._set_special_token(kind, tid)
        special.add_to_gguf(writer, quiet=True)
    if hparams.get("vocab_size", 32000) == 49152:  # Granite small models
        writer.add_add_bos_token(False)
    return info


def add_codegemma_tokens(writer, model_dir: Path) -> None:
    """GemmaModel.set_vocab's CodeGemma special token ids (eot is the one gguf-py can write)."""
    import gguf

    special = gguf.SpecialVocab(model_dir, load_merges=False,
                                special_token_types=["prefix", "suffix", "middle", "fsep", "eot"])
    for kind, tid in (("prefix", 67), ("suffix", 69), ("middle", 68), ("fsep", 70), ("eot", 107)):
        special._set_special_token(kind, tid)
    special.chat_template = None  # written once already
    special.add_to_gguf(writer, quiet=True)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


# ------------------------------------------------------------------ byte-level BPE ("gpt2")


def add_bpe_vocab(writer, model_dir: Path, hparams: dict, special: dict[str, int] | None = None) -> VocabInfo:
    """TextModel._set_vocab_gpt2 (pre-tokenizer: bpe_pre_name); a SentencePiece-style BPE
    tokenizer.json as add_spm_style_vocab writes it. `special`: {kind: id} the converter class sets on
    SpecialVocab after reading it (_set_special_token: only kinds it has no id for)."""
    from quantkit.gguf.special_vocab import SpecialVocab

    tokenizer = load_bpe_tokenizer(model_dir)
    pre, source = bpe_pre_name(tokenizer, model_dir)
    if source == "spm-style":
        return add_spm_style_vocab(writer, model_dir, hparams)
    tokens, types = bpe_tokens(tokenizer, hparams.get("vocab_size"))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special_vocab = SpecialVocab(model_dir, load_merges=True)
    for kind, tid in (special or {}).items():
        special_vocab._set_special_token(kind, tid)
    special_vocab.add_to_gguf(writer, quiet=True)
    return VocabInfo("gpt2", pre, len(tokens), source)


def load_bpe_tokenizer(model_dir: Path):
    """The tokenizer as AutoTokenizer gives it to the converter: read through the tokenizers
    library alone (BPETokenizer) where that is the same, else through transformers."""
    if BPETokenizer.applies(model_dir):
        return BPETokenizer(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


class BPETokenizer:
    """What bpe_tokens and check_hash ask of AutoTokenizer's tokenizer, from tokenizer.json through
    the tokenizers library (transformers imports torch; its fast tokenizer wraps this same object).

    It applies where transformers adds nothing to tokenizer.json: a BPE model (transformers skips
    its decode clean-up for BPE) without byte fallback (transformers 5 rebuilds the normalizer and
    pre-tokenizer of the SentencePiece-style classes, e.g. LlamaTokenizer) and every added token and
    named special token of tokenizer_config.json already an added token of tokenizer.json
    (transformers would add the missing ones). tests/gguf/test_vocab_tokenizers.py compares it with
    AutoTokenizer."""

    SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")

    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer

        self.backend = self.backend_tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        self.vocab = self.backend.get_vocab(with_added_tokens=True)
        self.added_tokens_decoder = self.backend.get_added_tokens_decoder()

    @classmethod
    def applies(cls, model_dir: Path) -> bool:
        data = read_json(Path(model_dir) / "tokenizer.json")
        if (data.get("model") or {}).get("type") != "BPE" or data["model"].get("byte_fallback"):
            return False
        added = {t.get("content") for t in data.get("added_tokens", [])}
        config = read_json(Path(model_dir) / "tokenizer_config.json")
        named = [config.get(key) for key in cls.SPECIAL_KEYS]
        named = [t.get("content") if isinstance(t, dict) else t for t in named if t]
        listed = [t.get("content") for t in (config.get("added_tokens_decoder") or {}).values()]
        extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
        extra = [t.get("content") if isinstance(t, dict) else t for t in extra] if isinstance(extra, list) else [None]
        return all(t in added for t in [*named, *listed, *extra])

    def get_added_vocab(self) -> dict[str, int]:
        return {t.content: i for i, t in sorted(self.added_tokens_decoder.items())}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=False)


def bpe_tokens(tokenizer, vocab_size: int | None) -> tuple[list[str], list[int]]:
    """TextModel.get_vocab_base: tokens by id and their types."""
    import gguf

    vocab = tokenizer.vocab
    n = vocab_size if vocab_size is not None else len(vocab)
    if max(vocab.values()) >= n:
        raise UnsupportedError(f"the tokenizer has ids up to {max(vocab.values())}, beyond vocab_size {n}",
                               hint="the tokenizer and config.json disagree: set vocab_size in config.json to the "
                                    "tokenizer's size, or save both again")
    by_id = {i: t for t, i in vocab.items()}
    added, decoder = tokenizer.get_added_vocab(), tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(n):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif by_id[i] in added:
            token, kind = added_bpe_token(tokenizer, by_id[i], decoder[i])
            tokens.append(token)
            types.append(kind)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def added_bpe_token(tokenizer, token: str, added) -> tuple[str, int]:
    """An added token as get_vocab_base writes it: normalized once, CONTROL or USER_DEFINED."""
    import gguf

    if not added.normalized:
        token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
    if added.special or looks_special(token):
        return token, gguf.TokenType.CONTROL
    return token.replace("\u2581", " "), gguf.TokenType.USER_DEFINED


def looks_special(token: str) -> bool:
    """convert_hf_to_gguf.py's does_token_look_special."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
            or (token.startswith("<unused") and token.endswith(">")))


def bpe_pre_name(tokenizer, model_dir: Path) -> tuple[str, str]:
    """(llama.cpp pre-tokenizer name, how it was found: "hash", "structure" or "spm-style");
    UnsupportedError where llama.cpp would split some text differently (see the module docstring)."""
    digest = check_hash(tokenizer)
    if digest in KNOWN_PRE_HASHES:
        return KNOWN_PRE_HASHES[digest], "hash"
    name = pretokenizer.reading(pretokenizer.pipeline(tokenizer.backend_tokenizer))
    if name == "llama-bpe" and not adds_bos(tokenizer, model_dir):
        raise UnsupportedError("tokenizer.json (BPE, Llama 3 split): it adds no BOS token, and llama.cpp's "
                               "'llama-bpe' pre-tokenizer always does", hint=pretokenizer.BPE_HINT)
    if name == pretokenizer.SPM_STYLE_PRE:
        check_llama_hf_readable(model_dir)
        return name, "spm-style"
    return name, "structure"


def adds_bos(tokenizer, model_dir: Path) -> bool:
    """The tokenizer puts the GGUF's BOS id (SpecialVocab's) before the text."""
    from quantkit.gguf.special_vocab import SpecialVocab

    bos = SpecialVocab(model_dir).special_token_ids.get("bos")
    plain = tokenizer.encode("a", add_special_tokens=False)
    return bos is not None and tokenizer.encode("a")[:len(plain) + 1] == [bos, *plain]


def check_hash(tokenizer) -> str:
    """sha256 of str(token ids of CHKTXT), as convert_hf_to_gguf.py's get_vocab_base_pre."""
    return sha256(str(tokenizer.encode(CHKTXT)).encode()).hexdigest()


# ------------------------------------------------------------------ SentencePiece-style BPE ("gpt2")


def add_spm_style_vocab(writer, model_dir: Path, hparams: dict) -> VocabInfo:
    """A SentencePiece-style BPE tokenizer.json as Gemma4Model.set_vocab writes one (gguf-py's
    LlamaHfVocab: tokens, scores, types; the merges), under llama.cpp's BPE tokenizer with its
    SentencePiece-style pre-tokenizer (quantkit.gguf.pretokenizer) instead of the model-named
    "gemma4" tokenizer (which also forces BOS on)."""
    from quantkit.gguf.special_vocab import SpecialVocab

    tokens, scores, types = llama_hf_tokens(model_dir, hparams.get("vocab_size"))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pretokenizer.SPM_STYLE_PRE)
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    SpecialVocab(model_dir, load_merges=True).add_to_gguf(writer, quiet=True)
    return VocabInfo("gpt2", pretokenizer.SPM_STYLE_PRE, len(tokens), "spm-style")


def check_llama_hf_readable(model_dir: Path) -> None:
    """gguf-py's LlamaHfVocab reads a byte-fallback BPE tokenizer.json only with a Sequence decoder."""
    decoder = read_json(Path(model_dir) / "tokenizer.json").get("decoder") or {}
    if decoder.get("type") != "Sequence":
        raise UnsupportedError(f"{Path(model_dir) / 'tokenizer.json'}: its decoder is {decoder.get('type')}, and "
                               "gguf-py's LlamaHfVocab (the converter's reader of such a tokenizer) needs a Sequence",
                               hint=pretokenizer.SPM_HINT)


def llama_hf_tokens(model_dir: Path, vocab_size: int | None) -> tuple[list, list, list]:
    """gguf-py's LlamaHfVocab.all_tokens(), each token at its id, padded to vocab_size as get_vocab_base pads."""
    import gguf

    try:
        vocab = gguf.LlamaHfVocab(model_dir)
    except (FileNotFoundError, TypeError) as exc:
        raise UnsupportedError(f"{model_dir / 'tokenizer.json'}: gguf-py's LlamaHfVocab cannot read it ({exc})",
                               hint=pretokenizer.SPM_HINT) from exc
    tokens, scores, types = (list(x) for x in zip(*vocab.all_tokens()))
    ids = vocab.tokenizer.get_vocab()
    misplaced = next((i for i, t in enumerate(tokens) if ids.get(t.decode("utf-8")) != i), None)
    if misplaced is not None:
        raise UnsupportedError(f"{model_dir / 'tokenizer.json'}: the ids have a gap (gguf-py's LlamaHfVocab "
                               f"lists another token at {misplaced})", hint=pretokenizer.SPM_HINT)
    n = vocab_size if vocab_size is not None else len(tokens)
    if len(tokens) > n:
        raise UnsupportedError(f"the tokenizer has {len(tokens)} tokens, beyond vocab_size {n}",
                               hint="the tokenizer and config.json disagree: set vocab_size in config.json to the "
                                    "tokenizer's size, or save both again")
    for i in range(len(tokens), n):
        tokens.append(f"[PAD{i}]".encode())
        scores.append(ADDED_SCORE)
        types.append(gguf.TokenType.UNUSED)
    return tokens, scores, types


# ------------------------------------------------------------------ SentencePiece ("llama")


def add_sentencepiece_vocab(writer, model_dir: Path, hparams: dict) -> VocabInfo:
    """TextModel._set_vocab_sentencepiece."""
    from quantkit.gguf.special_vocab import SpecialVocab

    tokens, scores, types = sentencepiece_base(model_dir, hparams)
    for text, tid in read_json(model_dir / "added_tokens.json").items():
        if tid < len(tokens):
            tokens[tid], scores[tid], types[tid] = text.encode("utf-8"), ADDED_SCORE, USER_DEFINED
    decoder = read_json(model_dir / "tokenizer_config.json").get("added_tokens_decoder", {})
    for tid, entry in decoder.items():
        if int(tid) < len(tokens):
            set_added_token(tokens, scores, types, int(tid), entry)
    write_llama_vocab(writer, tokens, scores, types)
    SpecialVocab(model_dir, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
    return VocabInfo("llama", "default", len(tokens), "spm")


def set_added_token(tokens: list, scores: list, types: list, tid: int, entry: dict) -> None:
    """One tokenizer_config.json added_tokens_decoder entry, as _create_vocab_sentencepiece applies it."""
    token = entry["content"]
    if entry.get("special") or looks_special(token):
        types[tid] = CONTROL
    else:
        token = token.replace("\u2581", " ")
        types[tid] = USER_DEFINED
    scores[tid] = ADDED_SCORE
    tokens[tid] = token.encode("utf-8")


def sentencepiece_base(model_dir: Path, hparams: dict) -> tuple[list, list, list]:
    """The pieces of tokenizer.model with their scores and types, padded to the config's vocab_size."""
    sp = load_sentencepiece(model_dir)
    n = hparams.get("vocab_size_per_layer_input") or hparams.get("vocab_size") or sp.vocab_size()
    tokens = [f"[PAD{i}]".encode() for i in range(n)]
    scores, types = [SPM_PAD_SCORE] * n, [UNUSED] * n
    for i in range(min(n, sp.vocab_size())):
        tokens[i], scores[i], types[i] = sp.IdToPiece(i).encode("utf-8"), sp.GetScore(i), spm_type(sp, i)
    return tokens, scores, types


def load_sentencepiece(model_dir: Path):
    try:
        from sentencepiece import SentencePieceProcessor
    except ImportError as exc:
        raise InputError("converting a tokenizer.model needs the 'sentencepiece' package, which is not installed",
                         hint="pip install sentencepiece (a quantkit dependency: reinstalling quantkit brings "
                              "it)") from exc
    sp = SentencePieceProcessor()
    sp.LoadFromFile(str(model_dir / "tokenizer.model"))
    return sp


def spm_type(sp, i: int) -> int:
    import gguf

    if sp.IsUnknown(i):
        return gguf.TokenType.UNKNOWN
    if sp.IsControl(i):
        return gguf.TokenType.CONTROL
    if sp.IsUnused(i):
        return gguf.TokenType.UNUSED
    if sp.IsByte(i):
        return gguf.TokenType.BYTE
    return gguf.TokenType.NORMAL


def add_phi3_vocab(writer, model_dir: Path, hparams: dict) -> VocabInfo:
    """Phi3MiniModel.set_vocab: BPE for GPT2Tokenizer (Phi-4), else its own SentencePiece reading."""
    from quantkit.gguf.special_vocab import SpecialVocab

    config = read_json(model_dir / "tokenizer_config.json")
    if config.get("tokenizer_class") == "GPT2Tokenizer":
        return add_bpe_vocab(writer, model_dir, hparams)
    if not (model_dir / "tokenizer.model").is_file():
        raise UnsupportedError("Phi-3 conversion needs tokenizer.model (or a GPT2Tokenizer tokenizer_config.json)",
                               hint="copy tokenizer.model from the original Phi-3 checkpoint into the model directory")
    tokens, scores, types = sentencepiece_base(model_dir, {"vocab_size": hparams.get("vocab_size")})
    for text, tid in read_json(model_dir / "added_tokens.json").items():
        if tid < len(tokens):
            tokens[tid], scores[tid], types[tid] = text.encode("utf-8"), ADDED_SCORE, USER_DEFINED
    entries = [(int(i), e) for i, e in config.get("added_tokens_decoder", {}).items()]
    entries += [(int(e["id"]), e) for e in read_json(model_dir / "tokenizer.json").get("added_tokens", [])]
    for tid, entry in entries:
        tokens[tid], scores[tid] = entry["content"].encode("utf-8"), ADDED_SCORE
        types[tid] = CONTROL if entry.get("special") else USER_DEFINED
    write_llama_vocab(writer, tokens, scores, types)
    SpecialVocab(model_dir, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
    return VocabInfo("llama", "default", len(tokens), "spm")


def write_llama_vocab(writer, tokens: list, scores: list, types: list) -> None:
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)


# ------------------------------------------------------------------ Gemma 4 ("gemma4")

# Gemma4Model.set_vocab: always rendered (USER_DEFINED), so that the chat parser can read them
GEMMA4_VISIBLE = ("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>",
                  '<|"|>')


def check_gemma4_vocab(model_dir: Path) -> None:
    """Before any work: the tokenizer.json gguf-py's LlamaHfVocab reads (a byte-fallback BPE, Sequence decoder)."""
    model = read_json(model_dir / "tokenizer.json").get("model") or {}
    if model.get("type") != "BPE" or not model.get("byte_fallback", False):
        raise UnsupportedError(f"{model_dir / 'tokenizer.json'}: not a byte-fallback BPE tokenizer (type "
                               f"{model.get('type')}), which llama.cpp's Gemma 4 converter reads (gguf-py's "
                               "LlamaHfVocab)", hint="Gemma 4 checkpoints ship one; save the tokenizer again")
    check_llama_hf_readable(model_dir)


def add_gemma4_vocab(writer, model_dir: Path) -> VocabInfo:
    """Gemma4Model.set_vocab: LlamaHfVocab's tokens, scores and types as listed (no padding), the visible chat
    tokens USER_DEFINED, tokenizer model "gemma4" (no pre-tokenizer key), the merges and special ids,
    add_space_prefix false, BOS added."""
    import gguf

    from quantkit.gguf.special_vocab import SpecialVocab

    check_gemma4_vocab(model_dir)
    vocab = gguf.LlamaHfVocab(model_dir)
    tokens, scores, types = [], [], []
    for text, score, toktype in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(gguf.TokenType.USER_DEFINED if text.decode() in GEMMA4_VISIBLE else toktype)
    writer.add_tokenizer_model("gemma4")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    SpecialVocab(model_dir, load_merges=True).add_to_gguf(writer, quiet=True)
    writer.add_add_space_prefix(False)
    writer.add_add_bos_token(True)
    return VocabInfo("gemma4", None, len(tokens))
