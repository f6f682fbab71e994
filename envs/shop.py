"""shop: a small WebShop-like web shop in pure Python (the paper's third benchmark, offline).

WebShop (Yao et al. 2022) is a web shop of 1.18M scraped Amazon products: the agent reads an instruction ("i need a
long lasting shampoo ... with scent: lavender, and price lower than 30.00 dollars"), searches, opens products, picks
options and buys; the reward grades how well the bought product fits. The original needs a product dump, a Java
(Lucene) index and spaCy. This module rebuilds the same game on a generated catalogue, with no downloads.

Catalogue. Generated deterministically from `seed`: 5 categories (beauty, food, fashion, furniture, electronics) x 10
product types x `n_per_type` products (default 16: 800 products). A product has an ASIN-like id (B0 + 8 characters),
a brand, a title holding its type noun ("Lumora Shampoo - Sulfate Free, Argan Oil"), 3-8 attributes from its
category's pool, 1-3 option axes (color, size, scent, flavor, style, capacity) with 2-5 values each, one price,
bullet points and a description. Titles, bullets and descriptions mention some attributes (not all), and some
products mention an attribute in their text that their attribute list lacks: as in WebShop, matching by text counts.

Pages and actions (WebShop's text mode: a page's visible text joined by " [SEP] "):
    search   WebShop [SEP] Instruction: [SEP] <instruction> [SEP] Search
    results  Back to Search [SEP] Page 1 (Total results: 50) [SEP] Next > [SEP] B0... [SEP] <title> [SEP] $12.99 ...
    item     Back to Search [SEP] < Prev [SEP] color [SEP] black [SEP] white ... [SEP] <title> [SEP] Price: $12.99
             [SEP] Rating: N.A. [SEP] Description [SEP] Features [SEP] Attributes [SEP] Buy Now
    sub-page Back to Search [SEP] < Prev [SEP] <description | bullet points | attributes and categories>
Actions are `search[keywords]` (only on the search page, which has the search bar) and `click[value]` with value one
of the page's clickables, compared lower-cased as WebShop's are: "back to search", "next >", "< prev", a product id,
an option value, "description", "features", "attributes", "buy now". Search is BM25 over each product's title,
description, first bullet and options (WebShop's index fields) and shows the top 50 results, 10 per page
(`page_size`). `click[buy now]` ends the episode (terminated) with the graded reward; `max_steps` actions end it
without a purchase (truncated, reward 0). Anything else - an unknown clickable, a search without a search bar, a
malformed action - changes nothing, gets reward 0 and the observation INVALID ("Invalid action."), which `is_invalid`
recognises.

Instructions, as WebShop's synthetic goals: "i need a {type} that is {a1} and {a2} with {option}: {value}, and
{option}: {value}, and price lower than {X} dollars", from a few templates, with 1-3 of the target product's
attributes, a value for each of its option axes, and X by WebShop's rule: among the multiples of 10 above the price,
take the first four, draw two and keep the larger.

Reward, as WebShop's get_reward (web_agent_site/engine/goal.py):
    R = r_type * (n_att + n_opt + 1[price <= X]) / (|goal attributes| + |goal options| + 1)
    n_att   goal attributes matched by a product attribute with token-set similarity > 0.85, or found as a substring
            of the lower-cased title, bullet points or description
    n_opt   goal options matched by a chosen option: exactly for the size axis, else after WebShop's colour
            normalisation by token-set similarity > 0.85
    r_type  1.0 if the bought product has the target's search query (its type) or shares at least 2 levels of its
            category path or title_score > 0.2, else 0.5; then 0.1 if title_score < 0.1 and 0.0 if title_score == 0,
            where title_score = |nouns(bought title) & nouns(target title)| / |nouns(target title)|
Success = reward 1.0 (info["won"]); episodes keep the graded reward.

Simplifications against WebShop, all deterministic:
  - nouns of a title are its words found in a fixed noun list (type nouns, brands, a few common nouns) instead of
    spaCy's part-of-speech tags;
  - token-set similarity is thefuzz's token_set_ratio rebuilt on difflib.SequenceMatcher (the standard library)
    instead of Levenshtein distance, as a fraction, not rounded to an integer;
  - size options match exactly (WebShop's fuzzy match lets "x-large" count as "large"); the generator keeps the
    values of every other axis pairwise distinct under the fuzzy match;
  - BM25 (k1 0.9, b 0.4, Lucene's idf, as pyserini's defaults) over lower-cased word tokens with a short stop-word
    list, no stemming; only products sharing a word with the query are shown;
  - one price per product (no price ranges), no reviews ("Rating: N.A."), no images;
  - the instruction appears on the search page only (ReAct's and ETO's prompts drop it from the other pages; the
    agent has it in its task line);
  - chosen options are shown as "You have clicked <value>." before the item page, as WebShop's text_rich mode does,
    so that an option click changes the observation;
  - "Next >" is shown only while more results exist, "< Prev" on results pages after the first;
  - search works only where the search bar is shown (WebShop's env accepts it anywhere).

Splits. Two product types per category are held out (`UNSEEN_TYPES`, 10 of 50):
    unseen - targets of held-out types (never the target of any other split's task)
    train / seen / dev - targets of the other types, split by product (crc32 of the id: 70% / 15% / 15%), so no two
             splits share a target product; seen and dev are the train distribution on new products, dev for model
             selection.
The catalogue is the same for every split: any product can be found and bought.

The expert searches the instruction's request (without its opening words and the price), opens the first result that
would score 1.0 with the goal's options (the target or an equivalent product; next page if needed, the target's title
if none of the 50 fits), clicks each goal option and buys. It clicks a product by its id as the page shows it
(`click[B0GBQYYBTV]`; the env lower-cases every click, so this is the same action as WebShop's `click[b0gbqyybtv]`,
and a model copies it from the page token for token). It writes ReAct text: a short `Thought:` where its plan
changes, a bare `Action:` elsewhere. With `hasty=p` (default 0) it is imperfect as WebShop's human demonstrators are:
on a share p of the tasks (`is_hasty`) it buys the product it opened without clicking the requested options, a
purchase the graded reward scores (n_att + 1[price]) / total, never 1.0. `admissible_actions()` lists the valid
actions of the page; `random_action(rng)` draws one of them (a baseline).
"""
import difflib
import functools
import math
import random
import re
import zlib
from collections import Counter

from envs._common import check_ranges, normalize_command, parse_task_id
from envs.base import TextEnv

INVALID = "Invalid action."
SEP = " [SEP] "
SEARCH_RETURN_N = 50   # WebShop: top 50 results ...
PAGE_SIZE = 10         # ... 10 per page (the page_size knob)
PRICE_RANGE = [10.0 * i for i in range(1, 100)]  # WebShop's price bounds

# ---------------------------------------------------------------------------- catalogue data
# A category: (path head, brands, attribute pool, types). A type: (query, article, subcategory,
# option axes, nouns of the type phrase, base price). An axis: (name, value pool).
SCENTS = ("scent", ["lavender", "vanilla", "coconut", "unscented", "rose", "citrus", "eucalyptus", "sandalwood"])
LIQUID = ("size", ["1 fl oz", "2 fl oz", "4 fl oz", "8 fl oz", "16 fl oz", "32 fl oz"])
WEIGHT = ("size", ["8 ounce", "12 ounce", "1 pound", "2 pound", "5 pound"])
COUNT = ("size", ["6 count", "12 count", "24 count", "36 count", "48 count"])
CLOTHES = ("size", ["x-small", "small", "medium", "large", "x-large", "xx-large"])
SHOES = ("size", ["6", "7", "7.5", "8", "8.5", "9", "9.5", "10", "11", "12"])
INCHES = ("size", ["18 inch", "24 inch", "30 inch", "36 inch", "48 inch", "60 inch"])
FEET = ("size", ["3 ft", "6 ft", "10 ft", "15 ft"])
PHONES = ("size", ["iphone 13", "iphone 14", "iphone 15", "galaxy s23", "pixel 8"])
WEAR = ("color", ["black", "white", "navy", "grey", "red", "olive", "khaki", "burgundy", "beige", "pink", "teal",
                  "brown"])
HOME = ("color", ["black", "white", "grey", "walnut", "espresso", "natural", "beige", "navy", "brown", "teal"])
TECH = ("color", ["black", "white", "silver", "blue", "red", "pink", "gold", "green", "purple"])
WIDTH = ("width", ["regular", "wide"])
MAKEUP = ("color", ["red", "pink", "nude", "coral", "plum", "mauve", "berry", "wine"])


def flavors(*values):
    return ("flavor", list(values))


CATEGORIES = {
    "beauty": ("Beauty & Personal Care",
               ["Lumora", "Verdane", "Solvia", "Aurelle", "Mireva", "Kalista", "Nuvelle", "Orlena"],
               ["paraben free", "sulfate free", "cruelty free", "fragrance free", "alcohol free", "long lasting",
                "natural ingredients", "sensitive skin", "dry skin", "oily skin", "travel size", "argan oil",
                "tea tree", "hyaluronic acid", "vitamin c", "dermatologist tested"],
               [("shampoo", "a ", "Hair Care", [SCENTS, LIQUID], ["shampoo"], 12),
                ("conditioner", "a ", "Hair Care", [SCENTS, LIQUID], ["conditioner"], 12),
                ("hair spray", "a ", "Hair Care", [SCENTS, LIQUID], ["hair", "spray"], 9),
                ("body lotion", "a ", "Skin Care", [SCENTS, LIQUID], ["body", "lotion"], 14),
                ("face serum", "a ", "Skin Care", [LIQUID], ["face", "serum"], 22),
                ("sunscreen", "a ", "Skin Care", [LIQUID], ["sunscreen"], 15),
                ("lipstick", "a ", "Makeup", [MAKEUP], ["lipstick"], 11),
                ("nail polish", "a ", "Makeup", [MAKEUP, LIQUID], ["nail", "polish"], 8),
                ("mascara", "a ", "Makeup", [("color", ["black", "brown", "navy", "plum"])], ["mascara"], 10),
                ("deodorant", "a ", "Personal Care", [SCENTS], ["deodorant"], 8)]),
    "food": ("Grocery & Gourmet Food",
             ["Harvestly", "Oakmere", "Sunpeak", "Gransby", "Millbrook", "Terravita", "Brightfield", "Copperleaf"],
             ["gluten free", "sugar free", "non gmo", "keto friendly", "low carb", "high protein", "usda organic",
              "kosher certified", "ready to eat", "individually wrapped", "plant based", "dairy free",
              "low sodium", "caffeine free", "fair trade", "no artificial flavors"],
             [("protein bars", "", "Snacks", [flavors("chocolate", "peanut butter", "vanilla", "cinnamon", "caramel"),
                                              COUNT], ["protein", "bars"], 25),
              ("beef jerky", "", "Snacks", [flavors("original", "teriyaki", "barbecue", "peppered"), WEIGHT],
               ["beef", "jerky"], 14),
              ("trail mix", "", "Snacks", [flavors("original", "honey", "chocolate", "sea salt"), WEIGHT],
               ["trail", "mix"], 11),
              ("granola", "", "Breakfast", [flavors("honey", "cinnamon", "blueberry", "vanilla", "hazelnut"), WEIGHT],
               ["granola"], 8),
              ("coffee beans", "", "Beverages",
               [flavors("original", "mocha", "hazelnut", "caramel", "vanilla"), WEIGHT],
               ["coffee", "beans"], 16),
              ("green tea", "", "Beverages", [flavors("original", "lemon", "honey", "jasmine"), COUNT],
               ["tea"], 9),
              ("hot cocoa", "", "Beverages", [flavors("original", "caramel", "hazelnut", "peppermint"), COUNT],
               ["cocoa"], 10),
              ("olive oil", "", "Pantry", [WEIGHT], ["olive", "oil"], 18),
              ("honey", "", "Pantry", [flavors("original", "lemon", "cinnamon"), WEIGHT], ["honey"], 12),
              ("pasta sauce", "", "Pantry", [flavors("marinara", "basil", "garlic", "vodka"), WEIGHT],
               ["pasta", "sauce"], 7)]),
    "fashion": ("Clothing, Shoes & Jewelry",
                ["Northvale", "Strideon", "Tallis", "Vexa", "Corvane", "Urbanic", "Fieldhaus", "Maelo"],
                ["machine wash", "hand wash", "slim fit", "relaxed fit", "long sleeve", "short sleeve",
                 "elastic waist", "rubber sole", "moisture wicking", "quick drying", "button closure",
                 "zipper closure", "lace up", "daily wear", "cotton blend", "stretch fabric"],
                [("t-shirt", "a ", "Tops", [WEAR, CLOTHES], ["shirt"], 15),
                 ("hoodie", "a ", "Tops", [WEAR, CLOTHES], ["hoodie"], 32),
                 ("jacket", "a ", "Tops", [WEAR, CLOTHES], ["jacket"], 55),
                 ("jeans", "", "Bottoms", [WEAR, CLOTHES], ["jeans"], 38),
                 ("leggings", "", "Bottoms", [WEAR, CLOTHES], ["leggings"], 22),
                 ("shorts", "", "Bottoms", [WEAR, CLOTHES], ["shorts"], 20),
                 ("running shoes", "", "Shoes", [WEAR, SHOES, WIDTH], ["shoes"], 60),
                 ("sneakers", "", "Shoes", [WEAR, SHOES, WIDTH], ["sneakers"], 50),
                 ("hiking boots", "", "Shoes", [WEAR, SHOES, WIDTH], ["boots"], 75),
                 ("socks", "", "Accessories", [WEAR, CLOTHES], ["socks"], 12)]),
    "furniture": ("Home & Kitchen",
                  ["Halden", "Norrix", "Cassel", "Tovera", "Linnea", "Brevik", "Somerton", "Ardent"],
                  ["easy assembly", "solid wood", "metal frame", "space saving", "height adjustable", "living room",
                   "faux leather", "storage space", "mid century", "non slip", "lumbar support", "engineered wood",
                   "home office", "tool free", "scratch resistant"],
                  [("office chair", "an ", "Seating", [HOME, ("style", ["with arms", "armless", "high back"]),
                                                        ("material", ["mesh", "fabric", "velvet"])],
                    ["office", "chair"], 120),
                   ("bar stool", "a ", "Seating", [HOME, INCHES], ["bar", "stool"], 60),
                   ("storage ottoman", "a ", "Seating", [HOME, INCHES], ["storage", "ottoman"], 45),
                   ("coffee table", "a ", "Tables", [HOME, INCHES], ["coffee", "table"], 90),
                   ("nightstand", "a ", "Tables", [HOME], ["nightstand"], 55),
                   ("writing desk", "a ", "Tables", [HOME, INCHES], ["desk"], 110),
                   ("bookshelf", "a ", "Storage", [HOME, ("style", ["3-tier", "4-tier", "5-tier"])], ["bookshelf"], 70),
                   ("tv stand", "a ", "Storage", [HOME, INCHES], ["tv", "stand"], 100),
                   ("shoe rack", "a ", "Storage", [HOME, ("style", ["2-tier", "3-tier", "4-tier"])],
                    ["shoe", "rack"], 30),
                   ("floor lamp", "a ", "Lighting", [HOME], ["floor", "lamp"], 40)]),
    "electronics": ("Electronics",
                    ["Voltix", "Zentra", "Ampero", "Novatek", "Sonique", "Pixelon", "Kinetra", "Auralink"],
                    ["fast charging", "noise cancelling", "water resistant", "high definition", "long battery life",
                     "wireless bluetooth", "usb type c", "plug and play", "hands free", "heavy duty", "high speed",
                     "compact design", "easy to install", "built in microphone", "overheat protection"],
                    [("bluetooth speaker", "a ", "Audio", [TECH], ["speaker"], 35),
                     ("wireless earbuds", "", "Audio", [TECH], ["earbuds"], 45),
                     ("headphones", "", "Audio", [TECH], ["headphones"], 60),
                     ("phone case", "a ", "Accessories", [TECH, PHONES, ("style", ["slim", "rugged", "wallet"])],
                      ["phone", "case"], 14),
                     ("usb cable", "a ", "Accessories", [TECH, FEET], ["cable"], 9),
                     ("hdmi cable", "an ", "Accessories", [("color", ["black", "white", "grey"]), FEET], ["cable"], 11),
                     ("wall charger", "a ", "Accessories", [TECH], ["wall", "charger"], 18),
                     ("power bank", "a ", "Accessories", [TECH, ("capacity", ["5000mah", "10000mah", "26800mah"])],
                      ["power", "bank"], 30),
                     ("computer mouse", "a ", "Computers", [TECH], ["computer", "mouse"], 20),
                     ("webcam", "a ", "Computers", [TECH, ("style", ["720p", "1080p", "4k"])], ["webcam"], 40)]),
}

# Held out for the unseen split: two types per category.
UNSEEN_TYPES = {"hair spray", "mascara", "trail mix", "hot cocoa", "hoodie", "hiking boots", "bar stool", "floor lamp",
                "headphones", "webcam"}

# The fixed noun list that replaces spaCy's tagger in r_type: type nouns, brands, and the other
# nouns the generated titles use.
NOUNS = ({n for _, brands, _, types in CATEGORIES.values() for t in types for n in t[4]}
         | {b.lower() for _, brands, _, _ in CATEGORIES.values() for b in brands}
         | {"skin", "oil", "tree", "acid", "vitamin", "ingredients", "protein", "carb", "sodium", "flavors", "trade",
            "waist", "sole", "sleeve", "closure", "fabric", "cotton", "wood", "frame", "leather", "room", "space",
            "support", "office", "battery", "life", "microphone", "protection", "design", "charging", "definition",
            "speed", "women", "men", "home", "pack"})

# WebShop's option normalisation keeps the first colour (in this list's order) found in a value.
COLOR_SET = ["beige", "berry", "black", "blue", "brown", "burgundy", "caramel", "chocolate", "coffee", "coral",
             "espresso", "gold", "green", "grey", "honey", "khaki", "lavender", "lemon", "mauve", "mocha", "natural",
             "navy", "nude", "olive", "pink", "plum", "purple", "red", "rose", "silver", "teal", "walnut", "white",
             "wine"]

SUFFIXES = {"beauty": [" for Women", " for Men"], "food": [", 2 Pack", ", Family Size"],
            "fashion": [" for Women", " for Men"], "furniture": [" for Home", " for Living Room"],
            "electronics": [", 2 Pack", " for Home"]}

STOPWORDS = {"a", "an", "and", "the", "of", "for", "with", "to", "in", "on", "is", "that", "i", "me", "need", "am",
             "looking", "want", "it", "its", "this", "by", "your", "you", "our", "from", "than"}

TEMPLATES = ["i need {art}{type} that is {attrs}{opts}{price}",
             "i am looking for {art}{type} that is {attrs}{opts}{price}",
             "find me {art}{type} that is {attrs}{opts}{price}",
             "i want to buy {art}{type} that is {attrs}{opts}{price}"]

BULLETS = ["{A}: made for {type} lovers who care about quality.",
           "{A} - tested by our team before it ships.",
           "Thoughtfully made: {a}, the way it should be.",
           "Why {brand}? Because it is {a}."]
FILLERS = ["Backed by our 30 day satisfaction guarantee.", "Ships in recyclable packaging.",
           "A great gift for family and friends.", "Designed by {brand} in our studio."]


# ---------------------------------------------------------------------------- text matching
def _words(text):
    return re.findall(r"[a-z0-9]+", text.lower())


@functools.lru_cache(maxsize=None)
def similarity(a, b):
    """thefuzz's token_set_ratio / 100 on difflib: compare the shared words plus each side's rest."""
    ta, tb = set(_words(a)), set(_words(b))
    if not ta or not tb:
        return 0.0
    sect = " ".join(sorted(ta & tb))
    if sect and (ta <= tb or tb <= ta):
        return 1.0
    c1 = " ".join(filter(None, [sect, " ".join(sorted(ta - tb))]))
    c2 = " ".join(filter(None, [sect, " ".join(sorted(tb - ta))]))
    ratio = lambda x, y: difflib.SequenceMatcher(None, x, y).ratio()  # noqa: E731
    return max(ratio(sect, c1) if sect else 0.0, ratio(sect, c2) if sect else 0.0, ratio(c1, c2))


def normalize_color(value):
    """WebShop's normalize_color: the first colour of COLOR_SET found in the value, else the value."""
    return next((c for c in COLOR_SET if c in value), value)


def option_match(axis, chosen, wanted):
    if axis == "size":
        return chosen == wanted
    return similarity(normalize_color(chosen), normalize_color(wanted)) > 0.85


def title_nouns(title):
    return {w for w in _words(title) if w in NOUNS}


def type_reward(bought, target):
    """WebShop's get_type_reward with the fixed noun list; returns (r_type, title_score)."""
    query_match = bought["query"] == target["query"]
    category_match = len(set(bought["path"]) & set(target["path"])) >= 2
    want = title_nouns(target["title"])
    title_score = len(title_nouns(bought["title"]) & want) / len(want) if want else 0.2
    r_type = 1.0 if (query_match or category_match or title_score > 0.2) else 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return r_type, title_score


def attribute_matches(product, goal_attrs):
    text = product.get("text") or " ".join([product["title"], " ".join(product["bullets"]),
                                             product["description"]]).lower()
    return sum(1 for g in goal_attrs
               if any(similarity(p, g) > 0.85 for p in product["attributes"]) or g in text)


def get_reward(product, goal, options, target):
    """WebShop's get_reward. product: the bought product; goal: dict with attributes, options
    (axis -> value) and price_upper; options: the chosen options (axis -> value); target: the
    goal's product (its query, category path and title define the type). -> (R, info)."""
    r_type, title_score = type_reward(product, target)
    n_att = attribute_matches(product, goal["attributes"])
    n_opt = sum(1 for axis, want in goal["options"].items()
                if any(option_match(axis, v, want) for v in options.values()))
    r_price = product["price"] <= goal["price_upper"]
    total = len(goal["attributes"]) + len(goal["options"]) + 1
    reward = r_type * (n_att + n_opt + r_price) / total
    return reward, {"r_type": r_type, "title_score": title_score, "n_att": n_att, "n_opt": n_opt,
                    "r_price": bool(r_price), "total": total}


# ---------------------------------------------------------------------------- BM25
class BM25:
    """Okapi BM25 over word tokens, Lucene's idf; search() returns document indices, best first
    (ties by index), only documents sharing a word with the query."""

    def __init__(self, docs, k1=0.9, b=0.4):
        self.k1, self.b = k1, b
        toks = [[w for w in _words(d) if w not in STOPWORDS] for d in docs]
        self.len = [len(t) for t in toks]
        self.avg = sum(self.len) / len(toks)
        self.postings = {}
        for i, t in enumerate(toks):
            for w, tf in Counter(t).items():
                self.postings.setdefault(w, []).append((i, tf))
        n = len(docs)
        self.idf = {w: math.log(1 + (n - len(p) + 0.5) / (len(p) + 0.5)) for w, p in self.postings.items()}

    def search(self, query, k=SEARCH_RETURN_N):
        scores = Counter()
        for w in _words(query):
            for i, tf in self.postings.get(w, ()):
                norm = self.k1 * (1 - self.b + self.b * self.len[i] / self.avg)
                scores[i] += self.idf[w] * tf * (self.k1 + 1) / (tf + norm)
        return [i for i, _ in sorted(scores.items(), key=lambda x: (-x[1], x[0]))[:k]]


# ---------------------------------------------------------------------------- generation
def _distinct_values(rng, axis, pool, k):
    """k values of an axis drawn from pool, pairwise distinct under option_match."""
    out = []
    for v in rng.sample(pool, len(pool)):
        if len(out) < k and not any(option_match(axis, v, u) or option_match(axis, u, v) for u in out):
            out.append(v)
    return sorted(out, key=pool.index)


def _make_product(rng, cat, head, brands, pool, spec, asin):
    query, art, sub, axes, _, base = spec
    brand = rng.choice(brands)
    attrs = rng.sample(pool, rng.randint(3, 8))
    rest = [a for a in pool if a not in attrs]
    text_only = [rng.choice(rest)] if rest and rng.random() < 0.3 else []  # only the text mentions it
    in_title = attrs[:rng.choice([1, 2, 2, 3])]
    hidden = attrs[len(in_title):]
    in_bullets = rng.sample(hidden, min(len(hidden), rng.randint(0, 2))) + text_only
    title = f"{brand} {query.title()} - " + ", ".join(a.title() for a in in_title)
    if rng.random() < 0.3:
        title += rng.choice(SUFFIXES[cat])
    bullets = [rng.choice(BULLETS).format(A=a.upper(), a=a, type=query, brand=brand) for a in in_bullets]
    bullets += [f.format(brand=brand) for f in rng.sample(FILLERS, rng.randint(1, 2))]
    rng.shuffle(bullets)
    described = [a for a in attrs if rng.random() < 0.25]
    description = f"The {brand} {query} is made for daily use."
    if described:
        description += " It is " + " and ".join(described) + "."
    options = {}
    for name, values in axes:  # a value names one option of the product (click[value])
        free = [v for v in values if not any(v in vs for vs in options.values())]
        options[name] = _distinct_values(rng, name, free, rng.randint(2, min(5, len(free))))
    price = round(base * math.exp(rng.uniform(-0.6, 0.6)), 0) - 0.01
    text = " ".join([title, " ".join(bullets), description]).lower()  # what attribute matching reads
    return {"asin": asin, "category": cat, "query": query, "article": art, "path": [head, sub, query], "brand": brand,
            "title": title, "attributes": attrs, "in_title": in_title, "text_only": text_only, "bullets": bullets,
            "description": description, "options": options, "price": price, "text": text}


_CATALOGUES = {}


def build_catalogue(seed=0, n_per_type=16):
    """The products (a list) and their BM25 index, built once per (seed, n_per_type)."""
    key = (seed, n_per_type)
    if key not in _CATALOGUES:
        rng = random.Random(f"shop/{seed}/catalogue")
        products, asins = [], set()
        for cat, (head, brands, pool, types) in CATEGORIES.items():
            for spec in types:
                for _ in range(n_per_type):
                    asin = None
                    while asin is None or asin in asins:  # a fresh ASIN-like id
                        asin = "B0" + "".join(rng.choice("0123456789ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(8))
                    asins.add(asin)
                    products.append(_make_product(rng, cat, head, brands, pool, spec, asin))
        rng.shuffle(products)
        docs = [" ".join([p["title"], p["description"], p["bullets"][0],
                          ", and ".join(f"{k}: {', '.join(v)}" for k, v in p["options"].items())]) for p in products]
        _CATALOGUES[key] = (products, BM25(docs))
    return _CATALOGUES[key]


def split_of_product(p):
    """The split whose tasks may target product p (see the module docstring)."""
    if p["query"] in UNSEEN_TYPES:
        return "unseen"
    bucket = zlib.crc32(p["asin"].encode()) % 20
    return "train" if bucket < 14 else "seen" if bucket < 17 else "dev"


def _join(items):
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _price_text(p):
    return f"${p['price']:.2f}"


# ---------------------------------------------------------------------------- the env
class ShopEnv(TextEnv):
    """See the module docstring. Size knobs: n_per_type (products per type), page_size (results
    per page), max_steps, and the number of tasks per split; the demonstrator's haste."""

    name = "shop"
    splits = ("train", "seen", "unseen", "dev")

    def __init__(self, seed=0, n_per_type=16, page_size=PAGE_SIZE, max_steps=15, n_train=1000, n_seen=100,
                 n_unseen=100, n_dev=100, hasty=0.0):
        self.n_tasks = {"train": n_train, "seen": n_seen, "unseen": n_unseen, "dev": n_dev}
        # A ceiling on each size too: a size keyword allocates and loops.
        check_ranges("shop", [("n_per_type", n_per_type, 1, 1000), ("page_size", page_size, 1, 100),
                              ("max_steps", max_steps, 1, 1000),
                              *[(f"n_{split}", n, 1, 10**6) for split, n in self.n_tasks.items()],
                              ("hasty", hasty, 0, 1)])
        self.seed, self.page_size, self.hasty, self.max_steps = seed, page_size, hasty, max_steps
        self.products, self.index = build_catalogue(seed, n_per_type)
        self.by_asin = {p["asin"]: p for p in self.products}
        self.pools = {s: [p for p in self.products if split_of_product(p) == s] for s in self.splits}
        self.instruction = (
            "Web shopping agent. Reply with an optional 'Thought: ...' line, then 'Action: <command>'. "
            "Commands: search[keywords] where the page shows a Search bar; click[x] where x is a clickable of "
            "the page, lower-cased: a product id, an option value, back to search, next >, < prev, description, "
            "features, attributes, buy now. Buying ends the task; the reward (0 to 1) grades the product's type, "
            f"attributes, options and price against the instruction. A useless command gives '{INVALID}'"
        )
        self._task = None

    # ------------------------------------------------------------------ tasks
    def generate(self, task_id):
        """The goal of `task_id`, deterministically. Returns a dict (no side effects)."""
        split, index = parse_task_id(self, task_id, self.n_tasks)
        rng = random.Random(f"shop/{self.seed}/{split}/{index}")
        target = rng.choice(self.pools[split])
        # Mostly attributes the title shows (the words a search can find), sometimes one that only the
        # attribute list or the bullet points hold.
        shown = target["in_title"]
        attrs = rng.sample(shown, min(len(shown), rng.choice([1, 2, 2, 2, 3])))
        others = [a for a in target["attributes"] + target["text_only"] if a not in shown]
        if others and (len(attrs) == 1 or rng.random() < 0.3):
            attrs.append(rng.choice(others))
        options = {axis: rng.choice(values) for axis, values in target["options"].items()}
        bounds = [p for p in PRICE_RANGE if p > target["price"]][:4]
        upper = sorted(rng.sample(bounds, 2))[1]
        opts = " with " + ", and ".join(f"{k}: {v}" for k, v in options.items()) if options else ""
        art = target["article"]
        text = rng.choice(TEMPLATES).format(art=art, type=target["query"], attrs=_join(attrs), opts=opts,
                                            price=f", and price lower than {upper:.2f} dollars")
        return {"task_id": task_id, "asin": target["asin"], "type": target["query"], "article": art,
                "attributes": attrs, "options": options, "price_upper": upper, "task": text}

    # ------------------------------------------------------------------ pages
    def _shown(self):
        """Catalogue indices of the results on the current results page."""
        return self.results[(self.page_no - 1) * self.page_size:self.page_no * self.page_size]

    def _render(self):
        """(observation, clickables, has_search_bar) of the current page."""
        page = self.page
        if page == "search":
            return SEP.join(["WebShop", "Instruction:", self._task["task"], "Search"]), [], True
        if page == "done":
            return SEP.join(["Thank you for shopping with us!", "Your score (min 0.0, max 1.0)",
                             f"{self.reward:.2f}"]), [], False
        if page == "results":
            n = len(self.results)
            shown = self._shown()
            parts, clicks = ["Back to Search", f"Page {self.page_no} (Total results: {n})"], ["back to search"]
            if self.page_no > 1:
                parts.append("< Prev")
                clicks.append("< prev")
            if self.page_no * self.page_size < n:
                parts.append("Next >")
                clicks.append("next >")
            for i in shown:
                p = self.products[i]
                parts += [p["asin"], p["title"], _price_text(p)]
                clicks.append(p["asin"].lower())
            return SEP.join(parts), clicks, False
        p = self.by_asin[self.asin]
        parts, clicks = ["Back to Search", "< Prev"], ["back to search", "< prev"]
        if page == "item":
            clicked = [f"You have clicked {v}." for a in p["options"] if (v := self.chosen.get(a))]
            for axis, values in p["options"].items():
                parts += [axis] + values
                clicks += values
            parts += [p["title"], f"Price: {_price_text(p)}", "Rating: N.A.", "Description", "Features",
                      "Attributes", "Buy Now"]
            clicks += ["description", "features", "attributes", "buy now"]
            return SEP.join(clicked + parts), clicks, False
        if page == "description":
            parts.append(p["description"])
        elif page == "features":
            parts += p["bullets"]
        else:  # attributes
            parts += p["attributes"] + [p["category"], p["query"], " › ".join(p["path"])]
        return SEP.join(parts), clicks, False

    def admissible_actions(self):
        """The valid actions of the current page: every click (a product by its id as the page
        shows it), and `search[<keywords>]` (any keywords) where the search bar is shown."""
        _, clicks, bar = self._render()
        return (["search[<keywords>]"] if bar else []) + [f"click[{c.upper() if c.upper() in self.by_asin else c}]"
                                                          for c in clicks]

    # ------------------------------------------------------------------ episode
    def reset(self, task_id):
        self._task = self.generate(task_id)
        self.target = self.by_asin[self._task["asin"]]
        self.page, self.page_no, self.results, self.asin, self.chosen = "search", 1, [], None, {}
        self.queries, self._fits = [], {}
        self.reward, self.reward_info, self.t, self.done = 0.0, None, 0, False
        self._last_phase = None
        obs = self._render()[0]
        return obs, {"task": self._task["task"], "task_type": self._task["type"], "task_id": task_id}

    def _execute(self, action):
        """Apply one action; returns the new observation, or INVALID (nothing changed)."""
        m = re.fullmatch(r"(search|click)\[(.+)\]", action)
        if m is None:
            return INVALID
        name, arg = m.group(1), " ".join(m.group(2).lower().split())
        _, clicks, bar = self._render()
        if name == "search":
            if not bar or not arg:
                return INVALID
            self.queries.append(arg)
            self.results, self.page, self.page_no, self.chosen = self.index.search(arg), "results", 1, {}
        elif arg not in clicks:
            return INVALID
        elif arg == "back to search":
            self.page = "search"
        elif arg == "next >":
            self.page_no += 1
        elif arg == "< prev" and self.page == "results":
            self.page_no -= 1
        elif arg == "< prev" and self.page == "item":
            self.page, self.chosen = "results", {}
        elif arg == "< prev":
            self.page = "item"
        elif self.page == "results":
            self.page, self.asin, self.chosen = "item", arg.upper(), {}
        elif arg in ("description", "features", "attributes"):
            self.page = arg
        elif arg == "buy now":
            self.reward, self.reward_info = get_reward(self.by_asin[self.asin], self._task, self.chosen, self.target)
            self.page = "done"
        else:  # an option value of the item page
            axis = next(a for a, vs in self.by_asin[self.asin]["options"].items() if arg in vs)
            self.chosen[axis] = arg
        return self._render()[0]

    def step(self, action):
        self._check_step(self._task is not None)
        self._last_phase = self._plan()[0]
        obs = self._execute(normalize_command(action))
        self.t += 1
        terminated = self.page == "done"
        truncated = not terminated and self.t >= self.max_steps
        self.done = terminated or truncated
        reward = self.reward if terminated else 0.0
        info = {"task": self._task["task"], "won": terminated and reward == 1.0, "steps": self.t}
        if terminated:
            info["reward_info"] = self.reward_info
        return obs, reward, terminated, truncated, info

    def is_invalid(self, obs):
        return obs.strip() == INVALID

    def reading_question(self, rng):
        """A question about the page just read and its answer, for 00_pretrain.py's reading comprehension: what the
        instruction asks for; on a results page, a product's id (to copy) or which results are of the asked type (the
        choice a shopping agent makes there); on an item page, which of its options the instruction asks for, its
        price against the budget, or its type."""
        g = self._task
        if self.page == "results":
            shown = [self.products[i] for i in self._shown()]
            kind = rng.choice(["ids", "id", "type"]) if shown else "type"
            if kind == "ids":
                return "Question: which ids does this page show?", f"Answer: {', '.join(p['asin'] for p in shown)}."
            if kind == "id":
                p = rng.choice(shown)
                return f"Question: what is the id of {p['title']}?", f"Answer: {p['asin']}."
            hits = [p["asin"] for p in shown if p["query"] == g["type"]]
            return (f"Question: which results here are {g['article']}{g['type']}?",
                    f"Answer: {', '.join(hits) if hits else 'none'}.")
        if self.page == "item":
            p, kind = self.by_asin[self.asin], rng.choice(["options", "price", "type"])
            if kind == "options":
                asked = [v for a, v in g["options"].items() if v in p["options"].get(a, [])]
                return ("Question: which options here does the instruction ask for?",
                        f"Answer: {', '.join(asked) if asked else 'none'}.")
            if kind == "price":
                ok = "yes" if p["price"] <= g["price_upper"] else "no"
                return ("Question: is this item's price within the budget?",
                        f"Answer: {ok}, {_price_text(p)} against {g['price_upper']:.2f} dollars.")
        if self.page in ("item", "description", "features", "attributes"):
            p = self.by_asin[self.asin]
            return (f"Question: is this item {g['article']}{g['type']}?",
                    f"Answer: {'yes' if p['query'] == g['type'] else 'no'}, it is {p['article']}{p['query']}.")
        return "Question: what does the instruction ask for?", f"Answer: {self.expert_query()}."

    # ------------------------------------------------------------------ expert
    def fits(self, p):
        """Would buying p with the goal's options score 1.0? (cached per episode)"""
        if p["asin"] not in self._fits:
            chosen = {a: v for a, v in self._task["options"].items() if v in p["options"].get(a, [])}
            self._fits[p["asin"]] = get_reward(p, self._task, chosen, self.target)[0] == 1.0
        return self._fits[p["asin"]]

    def expert_query(self):
        """The expert's search: the instruction's request without its opening words and its price
        ("a face serum that is argan oil, sulfate free and natural ingredients with size: 4 fl oz"),
        one span a model copies from the instruction; BM25 drops the stop words."""
        g = self._task
        request = g["task"].split(", and price lower than")[0]
        return request[request.index(g["article"] + g["type"]):]

    def _plan(self):
        """(phase, action) of the expert on the current page."""
        if self.done:
            return None, None
        g = self._task
        if self.page == "search":
            if not self.queries:
                return "search", f"search[{self.expert_query()}]"
            return "search title", f"search[{self.target['title'].lower()}]"
        if self.page == "results":
            rank = next((r for r, i in enumerate(self.results) if self.fits(self.products[i])), None)
            if rank is None:
                return "back", "click[back to search]"
            if rank // self.page_size + 1 > self.page_no:
                return "next", "click[next >]"
            if rank // self.page_size + 1 < self.page_no:
                return "prev", "click[< prev]"
            return "open", f"click[{self.products[self.results[rank]]['asin']}]"  # the id as the page shows it
        if self.page == "item":
            p = self.by_asin[self.asin]
            if not self.fits(p):
                return "back", "click[< prev]"
            if self.is_hasty():
                return "buy", "click[buy now]"
            for axis, want in g["options"].items():
                if want in p["options"].get(axis, []) and self.chosen.get(axis) != want:
                    return "options", f"click[{want}]"
            return "buy", "click[buy now]"
        return "back", "click[< prev]"  # a sub-page

    def is_hasty(self):
        """Is the demonstrator hasty on this task? With probability `hasty` (decided per task,
        reproducibly) it buys the product it opened without clicking the requested options: a
        purchase that loses the options' share of the reward (n_opt = 0) and never scores 1.0."""
        return bool(self.hasty) and random.Random(f"hasty/{self.seed}/{self._task['task_id']}").random() < self.hasty

    def expert_action(self):
        return self._plan()[1]

    def expert_text(self):
        """ReAct text: a short thought where the plan changes, a bare action elsewhere."""
        phase, action = self._plan()
        if phase == self._last_phase:
            return f"Action: {action}"
        g = self._task
        opts = ", ".join(f"{k}: {v}" for k, v in g["options"].items())
        thoughts = {
            "search": f"I search for {g['article']}{g['type']} with the instruction's words.",
            "search title": "I search for the product by its title.",
            "next": "Nothing on this page fits; I check the next page.",
            "prev": "The product that fits is on the previous page.",
            "back": "This does not fit; I go back.",
            "buy": "Everything fits; I buy it.",
        }
        if phase == "open":
            p = self.by_asin[action[6:-1].upper()]
            thoughts["open"] = (f"The {g['type']} at {_price_text(p)} fits, under {g['price_upper']:.0f} dollars; "
                                "I open it.")
        if phase == "options":
            thoughts["options"] = f"I select {opts}."
        return f"Thought: {thoughts[phase]}\nAction: {action}"

    # ------------------------------------------------------------------ baseline
    def random_action(self, rng):
        """A uniformly random admissible action; a search uses 1-3 random catalogue words."""
        action = rng.choice(self.admissible_actions())
        if action.startswith("search["):
            p = rng.choice(self.products)
            words = _words(p["title"])
            action = f"search[{' '.join(rng.sample(words, min(len(words), rng.randint(1, 3))))}]"
        return action
