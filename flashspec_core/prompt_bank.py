"""A broad bank of user requests for the draft head's self-distilled data: 48 kinds of request crossed with
topics the target lists itself from ~100 seed domains, audiences, tones and lengths, so the head sees what
people type into a demo and not one generator's style. No data set: every topic, passage and code snippet is
written by the target (`flashspec_core.head_data` runs the stages).

A prompt is (kind, topic, text). Whole kinds (`HELDOUT_KINDS`) and a hashed share of topics never reach
training: they form the held-out split. `benchmarks/open_prompts.json` is written by hand, never from here.
"""
from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

DOMAINS = [
    "cooking", "baking", "gardening", "astronomy", "marine biology", "personal finance", "investing", "history of Europe",
    "ancient civilizations", "world geography", "climate and weather", "renewable energy", "cars and driving",
    "aviation", "railways", "software engineering", "web development", "databases", "machine learning",
    "computer hardware", "cybersecurity", "mobile phones", "video games", "board games", "football", "basketball",
    "tennis", "running and fitness", "yoga", "nutrition", "medicine", "mental health", "sleep science", "parenting",
    "education", "learning languages", "grammar and writing", "poetry", "novels", "film", "television", "music theory",
    "rock music", "classical music", "painting", "photography", "architecture", "interior design", "fashion",
    "travel in Asia", "travel in South America", "hiking and camping", "pets", "dogs", "cats", "birds", "insects",
    "dinosaurs", "oceans", "rivers and lakes", "forests", "deserts", "mountains", "volcanoes and earthquakes",
    "chemistry", "physics", "mathematics", "statistics", "economics", "small business", "marketing", "job interviews",
    "careers", "office life", "law and rights", "politics and government", "philosophy", "psychology", "religion and myths",
    "holidays and festivals", "weddings", "friendship", "dating", "home repair", "cleaning", "plumbing", "electronics",
    "robotics", "space exploration", "inventions", "famous scientists", "urban planning", "farming", "fishing",
    "wine and beer", "coffee and tea", "street food", "science fiction", "fairy tales", "superheroes", "social media",
]

AUDIENCES = ["a five-year-old", "a ten-year-old", "a teenager", "a high-school student", "a university student",
             "a complete beginner", "an expert", "my grandmother", "a busy manager", "a new employee", "a tourist",
             "someone who is not a native English speaker"]
TONES = ["friendly", "formal", "funny", "serious", "enthusiastic", "calm", "persuasive", "neutral", "warm", "sarcastic",
         "encouraging", "professional"]
LENGTHS = ["in one sentence", "in two sentences", "in a short paragraph", "in about 100 words", "in three paragraphs",
           "briefly", "in detail", "in five bullet points", "in under 50 words"]
LANGUAGES = ["Python", "JavaScript", "Java", "C", "C++", "Go", "Rust", "SQL", "Bash", "TypeScript"]
FOLLOW_UPS = ["Can you make it shorter?", "Thanks! Can you give me an example?", "Explain the second point in more detail.",
              "Now write it for a child.", "Can you make it more formal?", "What would be a good title for that?",
              "Can you turn that into a list?", "Why is that?", "Can you add one more idea?", "Summarize that in one sentence.",
              "Great. What should I do next?", "Can you rewrite it in a funnier way?", "Is that always true?",
              "Translate the first sentence into French.", "ok and what about the downsides?"]

# kind -> templates. {topic} {audience} {tone} {length} {n} {lang}; material: {passage} {code} {items}; {a} {b} {c} numbers.
KINDS: dict[str, list[str]] = {
    "story": ["Write a short story about {topic}.", "Tell me a {tone} story about {topic} {length}.",
              "write a story for {audience} about {topic}", "Write a bedtime story that involves {topic}."],
    "poem": ["Write a poem about {topic}.", "Write a {tone} poem about {topic} with {n} stanzas.",
             "can you write me a short rhyming poem about {topic}"],
    "haiku": ["Write a haiku about {topic}.", "Give me {n} haikus about {topic}."],
    "song": ["Write the lyrics of a {tone} song about {topic}.", "Write a chorus for a song about {topic}."],
    "explain_child": ["Explain {topic} to {audience}.", "How would you explain {topic} to a kid?",
                      "explain {topic} like I'm five"],
    "explain_student": ["Explain {topic} to a student {length}.", "What is {topic}? Explain it {length}.",
                        "I have an exam tomorrow. Explain {topic} clearly."],
    "explain_expert": ["Give a technical explanation of {topic} for an expert.",
                       "Explain the mechanisms behind {topic} in depth."],
    "definition": ["What is {topic}?", "Define {topic} {length}.", "what does {topic} mean", "Give me a definition of {topic}."],
    "trivia": ["Tell me {n} fun facts about {topic}.", "What are some surprising facts about {topic}?",
               "Give me a trivia question about {topic} and its answer."],
    "history": ["What is the history of {topic}?", "How did {topic} develop over time?",
                "Give me a short timeline of {topic}."],
    "how_to": ["How do I get started with {topic}?", "Give me step-by-step instructions for {topic}.",
               "how to get better at {topic}", "What are the steps to learn {topic}?"],
    "advice": ["I want to get into {topic}. Any advice?", "What tips would you give {audience} about {topic}?",
               "My friend is struggling with {topic}. How can I help?"],
    "recipe": ["Give me a recipe inspired by {topic}.", "What can I cook tonight with rice, eggs and {topic}?",
               "Write a simple recipe for {audience}."],
    "letter": ["Write a {tone} letter to a friend about {topic}.", "Write a letter to my landlord about {topic}.",
               "Write a thank-you letter to a teacher who taught me about {topic}."],
    "email": ["Write a {tone} email to my manager about {topic}.", "Draft an email inviting my team to a talk on {topic}.",
              "write an email asking for a deadline extension because of {topic}"],
    "message": ["Write a short text message to a friend about {topic}.", "Write a birthday message that mentions {topic}."],
    "speech": ["Write a short {tone} speech about {topic}.", "Write a toast for a wedding that mentions {topic}."],
    "blog": ["Write a blog post introduction about {topic}.", "Write a {tone} blog post about {topic} {length}."],
    "product": ["Write a product description for a gadget related to {topic}.", "Write an ad for a course about {topic}."],
    "review": ["Write a review of a book about {topic}.", "Write a {tone} restaurant review that mentions {topic}."],
    "comparison": ["Compare {topic} and {topic2}.", "What is the difference between {topic} and {topic2}?",
                   "{topic} vs {topic2}: which is better for {audience}?"],
    "pros_cons": ["What are the pros and cons of {topic}?", "List the advantages and disadvantages of {topic}."],
    "list": ["List {n} things everyone should know about {topic}.", "Give me a list of {n} ideas related to {topic}.",
             "name {n} famous examples of {topic}"],
    "plan": ["Make a one-week plan to learn about {topic}.", "Plan a weekend trip centred on {topic}.",
             "Create a study plan for {topic} for {audience}."],
    "schedule": ["Make a daily schedule for someone who loves {topic}.", "Write a meeting agenda about {topic}."],
    "dialogue": ["Write a dialogue between two friends about {topic}.", "Write a conversation between a teacher and {audience} about {topic}."],
    "interview": ["Write five interview questions about {topic}.", "Pretend you are an expert on {topic} and answer: why does it matter?"],
    "opinion": ["What do you think about {topic}?", "Is {topic} overrated? Give your opinion.",
                "Why do people care about {topic}?"],
    "brainstorm": ["Brainstorm {n} creative ideas involving {topic}.", "Give me names for a club about {topic}.",
                   "Suggest {n} project ideas about {topic} for {audience}."],
    "quiz": ["Write a {n}-question multiple-choice quiz about {topic}.", "Make a quiz about {topic} with answers."],
    "motivation": ["Write a motivational message for someone learning {topic}.", "Encourage me to keep working on {topic}."],
    "joke": ["Tell me a joke about {topic}.", "Write {n} puns about {topic}."],
    "summary": ["Summarize the following text {length}.\n\n{passage}", "TL;DR:\n\n{passage}",
                "Give me the key points of this:\n\n{passage}"],
    "passage_qa": ["Read the text and answer: what is the main idea?\n\n{passage}",
                   "{passage}\n\nWhat does this text say about {topic}?",
                   "Answer using only this text: which facts does it give?\n\n{passage}"],
    "rewrite": ["Rewrite this text in a {tone} tone:\n\n{passage}", "Make this simpler for {audience}:\n\n{passage}",
                "Fix the grammar and improve the style:\n\n{passage}", "Shorten this text:\n\n{passage}"],
    "extract_json": ["Extract the key facts from this text as JSON:\n\n{passage}",
                     "Turn this list into a JSON array of objects with a name and a short description: {items}"],
    "table": ["Make a markdown table of these items with a short description each: {items}",
              "Create a table comparing {topic} and {topic2}."],
    "format_list": ["Sort these alphabetically and number them: {items}", "Turn this into a bulleted list: {items}"],
    "code_write": ["Write a {lang} function that {task}.", "write {lang} code that {task}",
                   "Show me how to write a program in {lang} that {task}."],
    "code_explain": ["Explain what this code does:\n\n```\n{code}\n```", "What does this function return?\n\n{code}",
                     "Explain this code line by line:\n\n```\n{code}\n```"],
    "code_fix": ["Find the bug in this code and fix it:\n\n```\n{code}\n```", "Why might this code fail?\n\n{code}",
                 "Add error handling to this code:\n\n```\n{code}\n```"],
    "code_convert": ["Convert this code to {lang}:\n\n```\n{code}\n```", "Rewrite this function in {lang}:\n\n{code}"],
    "code_test": ["Write unit tests for this function:\n\n```\n{code}\n```", "Add type hints and a docstring:\n\n{code}"],
    "sql": ["Write a SQL query that finds the top {n} customers by total spending.",
            "Write a SQL table schema for an app about {topic}."],
    "arithmetic": ["What is {a} + {b}?", "Compute {a} * {c}.", "What is {a} minus {b}?", "What is {c} percent of {a}?",
                   "Calculate ({a} + {b}) / {c}."],
    "word_problem": ["A shop sells {c} boxes of apples a day, each with {b} apples. How many apples does it sell in a week?",
                     "Tom has {a} dollars and spends {c} dollars a day. How many days until he has less than {b} dollars?",
                     "A train travels {b} km in {c} hours. What is its average speed?"],
    "logic": ["If all {topic} fans are happy and Sam is a {topic} fan, what follows?",
              "Solve this riddle and explain: what has keys but cannot open locks?"],
    "translate": ["Translate to French: 'I love learning about {topic}.'", "How do you say '{topic}' in Spanish?"],
}
CODE_TASKS = ["returns the n-th Fibonacci number", "checks whether a string is a palindrome", "counts the words in a text",
              "merges two sorted lists", "removes duplicates from a list", "reverses a string", "computes a factorial",
              "finds the largest number in a list", "converts Celsius to Fahrenheit", "parses a date string",
              "returns the prime numbers below n", "flattens a nested list", "counts the vowels in a string",
              "computes the median of a list", "validates an email address", "reads a CSV file", "sums the digits of a number",
              "finds the most common word in a text", "does a binary search", "computes the greatest common divisor",
              "splits a list into chunks", "checks whether two words are anagrams", "computes compound interest",
              "transposes a matrix", "sorts a list of dictionaries by a key", "generates a random password",
              "counts lines in a file", "converts a number to Roman numerals", "finds the second largest element",
              "checks if a year is a leap year", "calculates the area of a circle", "removes whitespace from a string"]
HELDOUT_KINDS = ("haiku", "speech", "code_test", "schedule")  # never trained on: the generator's held-out kinds
MATERIAL = {"passage": "Write a paragraph about {topic}.", "code": "Write a short {lang} function that {task}. Reply with only the code.",
            "items": "Name five things related to {topic}, separated by commas, on one line."}


@dataclass(frozen=True)
class Prompt:
    kind: str  # a key of KINDS, "self" (a user turn the target wrote) or "follow_up" (a second turn)
    topic: str  # what it is about ("" when none)
    text: str  # the user's words

    @property
    def heldout(self) -> bool:
        """Never trained on: a held-out kind or topic (a prompt without a topic is hashed by its text)."""
        return is_heldout(self.kind, self.topic or self.text)


def topic_request(domain: str, rng: random.Random) -> str:
    """A request that makes the target list topics of a domain (one per line)."""
    n = rng.choice([10, 15, 20])
    return rng.choice([f"List {n} specific topics related to {domain}, one per line.",
                       f"Give me {n} interesting subjects within {domain}. One per line, no explanations.",
                       f"What are {n} things people often ask about {domain}? Answer with short noun phrases, one per line."])


def parse_topics(text: str) -> list[str]:
    """Short noun phrases from a listed answer: numbering, bullets, bold and trailing explanations removed."""
    out = []
    for line in text.splitlines():
        line = re.sub(r"^\s*(\d+[.)]|[-*•])\s*", "", line).replace("**", "").strip()
        line = re.split(r"\s[-–:]\s|:\s", line)[0].strip(" .,:;\"'")
        if 3 <= len(line) <= 60 and len(line.split()) <= 7 and not line.lower().startswith(("here", "sure", "note")):
            out.append(line[0].lower() + line[1:] if not line[:2].isupper() else line)
    return out


def is_heldout(kind: str, topic: str, share: float = 0.05) -> bool:
    """Held out: a whole held-out kind, or a topic whose stable hash falls in the held-out share."""
    if kind in HELDOUT_KINDS:
        return True
    digest = hashlib.sha256(topic.lower().encode()).digest()
    return bool(topic) and int.from_bytes(digest[:4], "big") < share * 2 ** 32


def needs(template: str) -> str | None:
    """The material a template needs ("passage", "code", "items") or None."""
    return next((m for m in MATERIAL if "{" + m + "}" in template), None)


def fill(template: str, topic: str, rng: random.Random, topics: list[str], material: str = "") -> str:
    """One request from a template: random audience, tone, length, numbers; `material` fills its slot."""
    values = {"topic": topic, "topic2": rng.choice(topics), "audience": rng.choice(AUDIENCES), "tone": rng.choice(TONES),
              "length": rng.choice(LENGTHS), "n": rng.choice([3, 4, 5, 7, 10]), "lang": rng.choice(LANGUAGES),
              "task": rng.choice(CODE_TASKS), "a": rng.randint(12, 999), "b": rng.randint(2, 99), "c": rng.randint(2, 30),
              "passage": material, "code": material, "items": material}
    return casual(template.format(**values), rng)


def casual(text: str, rng: random.Random, share: float = 0.2) -> str:
    """People type loosely: a share of requests lose their capitals and final punctuation."""
    if rng.random() >= share or "\n" in text:
        return text
    return text[0].lower() + text[1:].rstrip(".?!")


def make_prompts(n: int, topics: list[str], materials: dict[str, list[tuple[str, str]]], rng: random.Random) -> list[Prompt]:
    """n prompts, kinds drawn uniformly, templates uniformly within a kind; a template whose material is missing
    is skipped. materials[m] holds (topic, text) pairs the target wrote."""
    out = []
    kinds = sorted(KINDS)
    while len(out) < n:
        kind = rng.choice(kinds)
        template = rng.choice(KINDS[kind])
        need = needs(template)
        if need is None:
            topic = rng.choice(topics)
            out.append(Prompt(kind, topic, fill(template, topic, rng, topics)))
        elif materials.get(need):
            topic, text = rng.choice(materials[need])
            out.append(Prompt(kind, topic, fill(template, topic, rng, topics, text)))
    return out


def material_requests(n: int, topics: list[str], rng: random.Random) -> list[tuple[str, str, str]]:
    """(material kind, topic, request) for n pieces: passages half, code and item lists a quarter each."""
    out = []
    for i in range(n):
        kind = "passage" if i % 4 < 2 else ("code" if i % 4 == 2 else "items")
        topic = rng.choice(topics)
        out.append((kind, topic, MATERIAL[kind].format(topic=topic, lang=rng.choice(LANGUAGES), task=rng.choice(CODE_TASKS))))
    return out


def clean_material(kind: str, text: str) -> str | None:
    """The usable part of a written passage, code snippet or item list, or None."""
    text = text.strip()
    if kind == "code":
        if "```" in text:  # the first fenced block (or all after an unclosed fence), without its language line
            text = text.split("```")[1].split("\n", 1)[-1]
        text = text.strip()
        return text if 20 <= len(text) <= 1500 else None
    if kind == "items":
        text = text.splitlines()[0].strip() if text else ""
        return text if text.count(",") >= 2 and len(text) <= 300 else None
    return text if 80 <= len(text) <= 1800 else None
