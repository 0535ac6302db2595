/* butter/native/team.c: the kernel thread ids of a step's OpenMP team.
 *
 * llama.cpp computes a graph with `#pragma omp parallel` from the thread that calls
 * llama_decode (the backend's thread), and libgomp keeps one pool of threads per such
 * thread: every later parallel region from it, llama.cpp's and butter's kernels', runs on
 * the same OS threads, thread i of the team on pool thread i. So a parallel region run from
 * the backend's thread names exactly the threads of every later step, and the team sizer
 * (butter/backends/team.py) can read how long each of them waited for a CPU
 * (/proc/self/task/<tid>/schedstat).
 *
 * The boundary with Python (ctypes): versioned by BUTTER_TEAM_ABI_VERSION, every caller
 * buffer comes with its size in bytes, and nothing is kept between calls.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#define BUTTER_TEAM_ABI_VERSION 2

#define BUTTER_E_SHORT (-1)
#define BUTTER_E_ARGUMENT (-2)
#define BUTTER_E_NO_OPENMP (-4)

int32_t butter_team_abi_version(void) { return BUTTER_TEAM_ABI_VERSION; }

/* Runs one parallel region of `n` threads from the calling thread; tids[i] gets thread
 * i's kernel thread id. Returns the number of threads the region had, or a BUTTER_E_*
 * status. */
int32_t butter_team_threads(int32_t n, int32_t *tids, size_t tids_bytes) {
#ifdef _OPENMP
    if (n < 1 || tids == NULL) {
        return BUTTER_E_ARGUMENT;
    }
    if (tids_bytes < (size_t)n * sizeof(int32_t)) {
        return BUTTER_E_SHORT;
    }
    memset(tids, 0, (size_t)n * sizeof(int32_t));
    int32_t team = 0;
    #pragma omp parallel num_threads(n)
    {
        tids[omp_get_thread_num()] = (int32_t)syscall(SYS_gettid);
        if (omp_get_thread_num() == 0) {
            team = omp_get_num_threads();
        }
    }
    return team;
#else
    (void)n; (void)tids; (void)tids_bytes;
    return BUTTER_E_NO_OPENMP;
#endif
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_team", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__team(void) { return PyModule_Create(&module); }
