"""English text the tiny tokenizer is trained on; fixed so the trained vocabulary never changes."""

TINY_CORPUS: tuple[str, ...] = (
    "The harbor town woke slowly. Fishing boats came back before sunrise, and the market filled with "
    "voices, gulls and the smell of salt. An old man sold bread from a blue cart while his daughter "
    "counted coins and wrote the prices on a small board. Children ran between the stalls, and the "
    "baker called out to every neighbor by name.",
    "A computer program is a list of instructions. The machine reads each instruction, changes a few "
    "numbers in memory, and moves on to the next one. Programs that serve many people at once must "
    "share the processor, the memory and the network fairly, so that no single request waits too long "
    "while another one holds every resource for itself.",
    "Language models predict the next word from the words before it. They read a prompt, turn every "
    "token into a vector, mix those vectors through many layers of attention and feed forward networks, "
    "and finally score each entry of the vocabulary. The highest score wins when decoding is greedy; "
    "sampling draws from the whole distribution instead.",
    "Serving a large model splits the work in two phases. During prefill the server reads the whole "
    "prompt in one pass and stores keys and values in a cache. During decode it produces one token at a "
    "time for each request in the batch, reading the cache again and again. Moving the cache from a "
    "prefill worker to a decode worker lets each phase run on hardware that suits it.",
    "The weather turned cold in the evening. Clouds rolled over the hills, the wind shook the windows, "
    "and rain began to fall on the roofs and the empty streets. Inside, a family sat near the fire, "
    "reading books, drinking tea and talking about the long summer that had just ended.",
    "Mathematics is the study of patterns. One plus one is two, two times three is six, and the square "
    "root of nine is three. A prime number has no divisors other than one and itself: two, three, five, "
    "seven, eleven and thirteen are the first few. Every proof starts from simple facts and builds, step "
    "by step, toward a result that nobody doubted once it was shown.",
    "User: What is the capital of France?\n\nAssistant: The capital of France is Paris.\n\n"
    "User: Can you write a short poem about the sea?\n\nAssistant: The sea is wide, the sea is deep, it "
    "sings the sailors off to sleep.\n\nUser: Thank you, that was lovely.\n\nAssistant: You are welcome!",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, i * 2))\n\n"
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def step(self):\n"
    "        self.count += 1\n        return self.count\n",
    "Gardens need patience. Seeds sleep in the soil through the winter, and in spring the first green "
    "shoots push through the ground. A good gardener waters the plants in the morning, pulls the weeds "
    "before they spread, and watches the sky for frost. By autumn the baskets are full of apples, beans, "
    "carrots and potatoes.",
    "Trains leave the central station every ten minutes. The first one departs at six in the morning and "
    "the last one at midnight. Passengers should buy a ticket before boarding, keep their bags close, "
    "and listen for announcements about delays, changed platforms or closed lines.",
)
