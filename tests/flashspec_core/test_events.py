"""A round's display pieces: each token's text decoded after the accepted prefix it follows, each prefix once."""
import random

from flashspec_core.events import EventBuilder, text_decoder

TEXT = "Café au lait, s'il vous plaît! 🚀 Ünïcödé\n  def f(x):\n\treturn x ** 2  # 二乘\n\n- item one\n- item two"


class CountingTokenizer:
    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def decode(self, ids):
        self.calls += 1
        return self.inner.decode(ids)


def reference_pieces(tok, before, accepted, rejected, final):
    """The pieces as the round's events first decoded them: every run decodes its prefix again."""
    def run(prefix, new):
        out, prev = [], tok.decode(prefix)
        for t in new:
            prefix = prefix + [t]
            cur = tok.decode(prefix)
            out.append(cur[len(prev):] if cur.startswith(prev) else tok.decode([t]))
            prev = cur
        return out

    tail = before[-4:]
    base = tail + accepted
    return run(tail, accepted) + run(base, rejected) + run(base, final)


def test_pieces_read_as_before_with_each_prefix_decoded_once(embedded_engine):
    """Rounds cut at random from a text of multi-byte characters, emoji, tabs and newlines (a token can end inside a
    character): the same pieces as decoding every run's prefix afresh, with fewer decodes; a plain round (one final
    token) decodes twice."""
    tok = embedded_engine.tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False)
    rng = random.Random(0)
    for _ in range(200):
        at = rng.randrange(1, len(ids) - 12)
        a, r, f = rng.randrange(0, 5), rng.randrange(0, 5), rng.randrange(0, 2)
        parts = ids[:at], ids[at:at + a], ids[at + a:at + a + r], ids[at + a + r:at + a + r + f]
        counting, before = CountingTokenizer(tok), CountingTokenizer(tok)
        pieces = EventBuilder(counting, set()).pieces(*parts)
        assert pieces == reference_pieces(before, *parts), parts
        assert counting.calls <= before.calls - 2 + (a == 0) + (r == 0) + (f == 0)
    counting = CountingTokenizer(tok)
    EventBuilder(counting, set()).pieces(ids[:9], [], [], ids[9:10])
    assert counting.calls == 2


def test_the_text_decoder_reads_as_the_tokenizer_does(embedded_engine):
    """The events' decoder goes straight to the embedded tokenizer's backend (a BPE model, so transformers adds no
    clean-up) and gives `tokenizer.decode`'s text: slices of a text with multi-byte characters cut anywhere, random
    ids over the whole vocabulary, the chat template's special tokens; a tokenizer without a backend keeps its own."""
    tok = embedded_engine.tokenizer
    decode = text_decoder(tok)
    assert decode != tok.decode  # the backend's, not the fallback
    ids = tok.encode(TEXT, add_special_tokens=False)
    rng = random.Random(1)
    cases = [ids[i:j] for i, j in (sorted(rng.sample(range(len(ids) + 1), 2)) for _ in range(200))]
    cases += [[rng.randrange(len(tok)) for _ in range(rng.randrange(1, 8))] for _ in range(300)]
    cases += [embedded_engine.encode("Hi there"), []]
    for case in cases:
        assert decode(case) == tok.decode(case), case
    counting = CountingTokenizer(tok)
    assert text_decoder(counting) == counting.decode and text_decoder(None) is None
