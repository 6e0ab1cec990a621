/* NGRAM's shared trie in C: the same insert, eviction, anchors and BFS / PROB trees as drafter_svc/ngram.py's
 * Python twin, node for node and in the same order (tests/test_ngram.py checks the two against each other).
 * SGLang keeps its trie in C++ for the same reason: a request's insert is ~150 node updates per step, which
 * in Python costs ~0.2 ms of host time per request per step. Built by drafter_svc/ngram_native.py with the
 * system's C compiler and loaded through ctypes; no Python headers, no allocation visible to the caller. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int64_t freq, stamp;
    int32_t token, parent, first_child, next_sibling, prev_sibling, num_children;
} Node;

typedef struct {
    int min_window, max_window, min_bfs, max_bfs, prob, branch_length;
    int64_t capacity, num_nodes, clock;
    Node *nodes;
    int32_t used, allocated;          /* node slots handed out (0: the root), slots allocated */
    int32_t *free_ids; int32_t num_free, free_cap;
    uint64_t *keys; int32_t *vals;    /* (parent << 32 | token) -> child, open addressing, linear probing */
    uint64_t mask, count;
} Trie;

#define EMPTY UINT64_MAX

static uint64_t key_of(int32_t parent, int32_t token) { return ((uint64_t)(uint32_t)parent << 32) | (uint32_t)token; }
static uint64_t slot_of(uint64_t key, uint64_t mask) {  /* splitmix64's finalizer: every key bit moves the slot */
    key ^= key >> 30; key *= 0xBF58476D1CE4E5B9ull;
    key ^= key >> 27; key *= 0x94D049BB133111EBull;
    return (key ^ key >> 31) & mask;
}

static int32_t lookup(const Trie *t, int32_t parent, int32_t token) {
    uint64_t key = key_of(parent, token), i = slot_of(key, t->mask);
    while (t->keys[i] != EMPTY) {
        if (t->keys[i] == key) return t->vals[i];
        i = (i + 1) & t->mask;
    }
    return -1;
}

static int grow_table(Trie *t) {
    uint64_t old_cap = t->mask + 1, cap = old_cap * 2;
    uint64_t *keys = malloc(cap * sizeof *keys); int32_t *vals = malloc(cap * sizeof *vals);
    if (!keys || !vals) { free(keys); free(vals); return -1; }
    memset(keys, 0xff, cap * sizeof *keys);
    for (uint64_t j = 0; j < old_cap; j++) {
        if (t->keys[j] == EMPTY) continue;
        uint64_t i = slot_of(t->keys[j], cap - 1);
        while (keys[i] != EMPTY) i = (i + 1) & (cap - 1);
        keys[i] = t->keys[j]; vals[i] = t->vals[j];
    }
    free(t->keys); free(t->vals);
    t->keys = keys; t->vals = vals; t->mask = cap - 1;
    return 0;
}

static int put(Trie *t, int32_t parent, int32_t token, int32_t child) {
    if ((t->count + 1) * 2 > t->mask + 1 && grow_table(t)) return -1;
    uint64_t key = key_of(parent, token), i = slot_of(key, t->mask);
    while (t->keys[i] != EMPTY) i = (i + 1) & t->mask;
    t->keys[i] = key; t->vals[i] = child; t->count++;
    return 0;
}

static void erase(Trie *t, int32_t parent, int32_t token) {  /* backward-shift deletion keeps probing exact */
    uint64_t key = key_of(parent, token), i = slot_of(key, t->mask);
    while (t->keys[i] != key) { if (t->keys[i] == EMPTY) return; i = (i + 1) & t->mask; }
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & t->mask;
        if (t->keys[j] == EMPTY) break;
        uint64_t home = slot_of(t->keys[j], t->mask);
        /* move j's entry into the hole at i unless its home lies cyclically in (i, j] */
        if ((j > i && (home <= i || home > j)) || (j < i && home <= i && home > j)) {
            t->keys[i] = t->keys[j]; t->vals[i] = t->vals[j]; i = j;
        }
    }
    t->keys[i] = EMPTY; t->count--;
}

static int32_t new_node(Trie *t, int32_t parent, int32_t token) {
    int32_t id;
    if (t->num_free) id = t->free_ids[--t->num_free];
    else {
        if (t->used == t->allocated) {
            int32_t allocated = t->allocated * 2;
            Node *nodes = realloc(t->nodes, (size_t)allocated * sizeof *nodes);
            if (!nodes) return -1;
            t->nodes = nodes; t->allocated = allocated;
        }
        id = t->used++;
    }
    if (put(t, parent, token, id)) return -1;
    Node *n = &t->nodes[id], *p = &t->nodes[parent];
    n->freq = 0; n->stamp = 0; n->token = token; n->parent = parent; n->first_child = -1; n->num_children = 0;
    n->prev_sibling = -1; n->next_sibling = p->first_child;
    if (p->first_child >= 0) t->nodes[p->first_child].prev_sibling = id;
    p->first_child = id; p->num_children++;
    t->num_nodes++;
    return id;
}

static int remove_leaf(Trie *t, int32_t id) {
    Node *n = &t->nodes[id], *p = &t->nodes[n->parent];
    if (n->prev_sibling >= 0) t->nodes[n->prev_sibling].next_sibling = n->next_sibling;
    else p->first_child = n->next_sibling;
    if (n->next_sibling >= 0) t->nodes[n->next_sibling].prev_sibling = n->prev_sibling;
    p->num_children--;
    erase(t, n->parent, n->token);
    if (t->num_free == t->free_cap) {
        int32_t cap = t->free_cap ? t->free_cap * 2 : 1024;
        int32_t *ids = realloc(t->free_ids, (size_t)cap * sizeof *ids);
        if (!ids) return -1;
        t->free_ids = ids; t->free_cap = cap;
    }
    t->free_ids[t->num_free++] = id;
    n->parent = -2;  /* free */
    t->num_nodes--;
    return 0;
}

/* sort keys: (primary, secondary, node), ascending; qsort's comparator sees no trie (no global state: two
 * tries may be used from two threads at once) */
typedef struct { int64_t primary, secondary; int32_t node; } SortKey;
static int sort_key_cmp(const void *a, const void *b) {
    const SortKey *x = a, *y = b;
    if (x->primary != y->primary) return (x->primary > y->primary) - (x->primary < y->primary);
    return (x->secondary > y->secondary) - (x->secondary < y->secondary);
}

/* Drop the `count` least recently used leaves, repeatedly, as parents become leaves (the Python twin's _evict). */
static int evict(Trie *t, int64_t count) {
    SortKey *leaves = malloc((size_t)t->used * sizeof *leaves);
    if (!leaves) return -1;
    while (count > 0) {
        int32_t num = 0;
        for (int32_t id = 1; id < t->used; id++)
            if (t->nodes[id].parent != -2 && t->nodes[id].first_child < 0)
                leaves[num++] = (SortKey){t->nodes[id].stamp, 0, id};
        if (!num) break;
        qsort(leaves, num, sizeof *leaves, sort_key_cmp);  /* least recent first */
        int32_t take = (int64_t)num < count ? num : (int32_t)count;
        for (int32_t i = 0; i < take; i++)
            if (remove_leaf(t, leaves[i].node)) { free(leaves); return -1; }
        count -= take;
    }
    free(leaves);
    return 0;
}

void ngram_trie_free(Trie *t) {
    if (!t) return;
    free(t->nodes); free(t->free_ids); free(t->keys); free(t->vals); free(t);
}

Trie *ngram_trie_new(int min_window, int max_window, int min_bfs, int max_bfs, int prob, int branch_length,
                     int64_t capacity) {
    Trie *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->min_window = min_window; t->max_window = max_window; t->min_bfs = min_bfs; t->max_bfs = max_bfs;
    t->prob = prob; t->branch_length = branch_length; t->capacity = capacity;
    t->allocated = 1024; t->used = 1;
    t->nodes = malloc((size_t)t->allocated * sizeof *t->nodes);
    t->mask = 2047;
    t->keys = malloc((t->mask + 1) * sizeof *t->keys); t->vals = malloc((t->mask + 1) * sizeof *t->vals);
    if (!t->nodes || !t->keys || !t->vals) { ngram_trie_free(t); return NULL; }
    memset(t->keys, 0xff, (t->mask + 1) * sizeof *t->keys);
    Node *root = &t->nodes[0];
    memset(root, 0, sizeof *root);
    root->token = -1; root->parent = -1; root->first_child = -1; root->next_sibling = -1; root->prev_sibling = -1;
    return t;
}

int64_t ngram_trie_num_nodes(const Trie *t) { return t->num_nodes; }

/* Insert windows back to back (lengths[i] tokens each): every start i with i + min_window < len adds the
 * path window[i : i + branch_length], each node on it freq += 1 and the clock's next tick. 0, or -1 when
 * out of memory (the trie stays consistent up to the failing node). */
int ngram_trie_insert(Trie *t, const int32_t *tokens, const int32_t *lengths, int32_t num_windows) {
    for (int32_t w = 0; w < num_windows; w++) {
        int32_t len = lengths[w];
        for (int32_t start = 0; start < len - t->min_window; start++) {
            int32_t node = 0, end = start + t->branch_length < len ? start + t->branch_length : len;
            for (int32_t j = start; j < end; j++) {
                int32_t child = lookup(t, node, tokens[j]);
                if (child < 0 && (child = new_node(t, node, tokens[j])) < 0) return -1;
                t->nodes[child].freq++;
                t->nodes[child].stamp = ++t->clock;
                node = child;
            }
        }
        tokens += len;
        if (t->num_nodes > t->capacity && evict(t, t->num_nodes - t->capacity)) return -1;
    }
    return 0;
}

typedef struct { int32_t *tokens, *parents, size, max; } Builder;

static int32_t add(Builder *b, int32_t parent, int32_t token) {
    for (int32_t i = 1; i < b->size; i++)
        if (b->parents[i] == parent && b->tokens[i] == token) return i;
    b->tokens[b->size] = token; b->parents[b->size] = parent;
    return b->size++;
}

/* children of a node into *out (grown as needed), in the trie's order for the match type: BFS most recent
 * first, PROB most frequent first with ties by token id (SGLang's) */
static int32_t children(const Trie *t, int32_t node, SortKey **out, int32_t *cap, int prob) {
    int32_t n = t->nodes[node].num_children;
    if (n > *cap) {
        SortKey *grown = realloc(*out, (size_t)n * sizeof *grown);
        if (!grown) return -1;
        *out = grown; *cap = n;
    }
    int32_t i = 0;
    for (int32_t c = t->nodes[node].first_child; c >= 0; c = t->nodes[c].next_sibling) {
        const Node *k = &t->nodes[c];
        (*out)[i++] = prob ? (SortKey){-k->freq, k->token, c} : (SortKey){-k->stamp, 0, c};
    }
    qsort(*out, n, sizeof **out, sort_key_cmp);
    return n;
}

typedef struct { int32_t node, parent; double breadth; } QueueItem;
typedef struct { double key; int64_t order; int32_t node, parent; } HeapItem;

static int heap_less(const HeapItem *a, const HeapItem *b) { return a->key < b->key || (a->key == b->key && a->order < b->order); }

static int heap_push(HeapItem **heap, int32_t *size, int32_t *cap, HeapItem item) {
    if (*size == *cap) {
        int32_t grown_cap = *cap ? *cap * 2 : 64;
        HeapItem *grown = realloc(*heap, (size_t)grown_cap * sizeof *grown);
        if (!grown) return -1;
        *heap = grown; *cap = grown_cap;
    }
    int32_t i = (*size)++;
    while (i > 0) {
        int32_t up = (i - 1) / 2;
        if (!heap_less(&item, &(*heap)[up])) break;
        (*heap)[i] = (*heap)[up]; i = up;
    }
    (*heap)[i] = item;
    return 0;
}

static HeapItem heap_pop(HeapItem *heap, int32_t *size) {
    HeapItem top = heap[0], last = heap[--*size];
    int32_t i = 0;
    for (;;) {
        int32_t child = 2 * i + 1;
        if (child >= *size) break;
        if (child + 1 < *size && heap_less(&heap[child + 1], &heap[child])) child++;
        if (!heap_less(&heap[child], &last)) break;
        heap[i] = heap[child]; i = child;
    }
    if (*size) heap[i] = last;
    return top;
}

/* The tree for a context (its last token the root): tokens and parents of its nodes into out_*, which hold
 * max_nodes each. Returns the node count (1: the root only, the trie suggests nothing), -1 out of memory. */
int32_t ngram_trie_draft(const Trie *t, const int32_t *context, int32_t len, int32_t max_nodes,
                         int32_t *out_tokens, int32_t *out_parents) {
    if (len < 1 || max_nodes < 1) return 0;
    Builder b = {out_tokens, out_parents, 1, max_nodes};
    out_tokens[0] = context[len - 1]; out_parents[0] = -1;
    if (max_nodes == 1) return 1;
    SortKey *kids = NULL;
    int32_t kids_cap = 0, status = 0;
    QueueItem *queue = NULL; int32_t queue_cap = 0;
    HeapItem *heap = NULL; int32_t heap_size = 0, heap_cap = 0;
    int64_t order = 0;
    double scale = (double)(t->max_bfs - t->min_bfs) / (double)(t->max_window - t->min_window + 1);
    int32_t longest = len < t->max_window ? len : t->max_window;
    for (int32_t w = longest; w >= t->min_window && b.size < b.max; w--) {
        int32_t anchor = 0;
        for (int32_t j = len - w; j < len && anchor >= 0; j++) anchor = lookup(t, anchor, context[j]);
        if (anchor < 0 || t->nodes[anchor].first_child < 0) continue;
        if (!t->prob) {
            int32_t head = 0, tail = 0;
            if (queue_cap < 1) { queue_cap = 64; if (!(queue = malloc(queue_cap * sizeof *queue))) goto oom; }
            queue[tail++] = (QueueItem){anchor, 0, (double)(t->max_window - w) * scale + (double)t->min_bfs};
            while (head < tail && b.size < b.max) {
                QueueItem item = queue[head++];
                int32_t n = children(t, item.node, &kids, &kids_cap, 0);
                if (n < 0) goto oom;
                int32_t take = (int32_t)item.breadth > 1 ? (int32_t)item.breadth : 1;
                if (take > n) take = n;
                for (int32_t i = 0; i < take && b.size < b.max; i++) {
                    if (tail == queue_cap) {
                        QueueItem *grown = realloc(queue, (size_t)queue_cap * 2 * sizeof *grown);
                        if (!grown) goto oom;
                        queue = grown; queue_cap *= 2;
                    }
                    queue[tail++] = (QueueItem){kids[i].node, add(&b, item.parent, t->nodes[kids[i].node].token),
                                                item.breadth - scale};
                }
            }
        } else {
            int32_t pending[2] = {anchor, 0};  /* (node, builder index) whose children to push */
            double probability = 1.0;
            for (;;) {
                int32_t n = children(t, pending[0], &kids, &kids_cap, 1);
                if (n < 0) goto oom;
                if (n > t->max_bfs) n = t->max_bfs;
                int64_t total = 0;
                for (int32_t i = 0; i < n; i++) total += t->nodes[kids[i].node].freq;
                for (int32_t i = 0; i < n; i++) {
                    double key = -probability * (double)t->nodes[kids[i].node].freq / (double)total;
                    if (heap_push(&heap, &heap_size, &heap_cap, (HeapItem){key, order++, kids[i].node, pending[1]})) goto oom;
                }
                if (!heap_size || b.size >= b.max) break;
                HeapItem top = heap_pop(heap, &heap_size);
                pending[0] = top.node; pending[1] = add(&b, top.parent, t->nodes[top.node].token);
                probability = -top.key;
            }
        }
    }
    status = b.size;
    goto done;
oom:
    status = -1;
done:
    free(kids); free(queue); free(heap);
    return status;
}

/* Trees for n contexts in one call (one crossing of the FFI, not n): context i is contexts[starts[i] .. starts[i + 1]),
 * its tree goes to out_tokens / out_parents from offsets[i], offsets[i + 1] - offsets[i] nodes at most, and counts[i]
 * is its node count (as ngram_trie_draft's). Returns 0, or -1 out of memory. */
int32_t ngram_trie_draft_batch(const Trie *t, const int32_t *contexts, const int32_t *starts, int32_t n,
                               const int32_t *offsets, int32_t *out_tokens, int32_t *out_parents, int32_t *counts) {
    for (int32_t i = 0; i < n; i++) {
        int32_t count = ngram_trie_draft(t, contexts + starts[i], starts[i + 1] - starts[i], offsets[i + 1] - offsets[i],
                                         out_tokens + offsets[i], out_parents + offsets[i]);
        if (count < 0) return -1;
        counts[i] = count;
    }
    return 0;
}
