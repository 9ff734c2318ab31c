/* SPDX-License-Identifier: Apache-2.0 */
/* The run-time CUDA driver loader where there is no driver: a missing library and a library that
 * is not a CUDA driver both leave it "unavailable" with a reason naming the cause, and every
 * query then answers without crashing (addresses are host memory, device operations are refused).
 * Each test runs in its own process, so each loads the driver afresh from KVB_CUDA_LIBRARY. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "kvbridge/engine.h"
#include "transport/cuda_driver.h"

#define MISSING "/nonexistent/libcuda.so.1"

/* Set before the first kvb__cuda_* call of the test's process: the driver is loaded only once. */
static void use_missing(void)
{
    kvb_log_set_level(0); /* refused operations log errors by design */
    cr_assert_eq(setenv("KVB_CUDA_LIBRARY", MISSING, 1), 0);
}

static void use_libm(void)
{
    kvb_log_set_level(0);
    cr_assert_eq(setenv("KVB_CUDA_LIBRARY", "libm.so.6", 1), 0);
}

static void use_default(void)
{
    kvb_log_set_level(0);
    cr_assert_eq(unsetenv("KVB_CUDA_LIBRARY"), 0);
}

TestSuite(cuda_missing, .init = use_missing, .timeout = 10);
TestSuite(cuda_not_driver, .init = use_libm, .timeout = 10);
TestSuite(cuda_default, .init = use_default, .timeout = 10);

Test(cuda_missing, unavailable_with_reason)
{
    cr_assert_not(kvb__cuda_available());
    const char *why = kvb__cuda_reason();
    cr_assert(strstr(why, MISSING), "reason names the path: %s", why);
    cr_assert(strstr(why, "cannot open shared object file"), "reason quotes dlerror: %s", why);
    cr_assert_null(kvb__cuda());
    cr_assert_eq(kvb__cuda_device_count(), 0);
}

Test(cuda_missing, device_operations_refused)
{
    char bus[KVB_CUDA_BUS_ID_LEN];
    uint64_t base = 1, size = 1;
    int device = 7;
    cr_assert_eq(kvb__cuda_use(0), KVB_ERR_UNSUPPORTED);
    cr_assert_eq(kvb__cuda_use(-1), KVB_ERR_UNSUPPORTED);
    cr_assert_eq(kvb__cuda_range(0x1000, &base, &size), KVB_ERR_UNSUPPORTED);
    cr_assert_eq(base, 1, "outputs untouched on failure");
    cr_assert_eq(size, 1);
    cr_assert_eq(kvb__cuda_bus_id(0, bus, sizeof bus), KVB_ERR_UNSUPPORTED);
    cr_assert_eq(kvb__cuda_device_by_bus_id("0000:1b:00.0", &device), KVB_ERR_UNSUPPORTED);
    cr_assert_eq(kvb__cuda_device_by_bus_id(NULL, &device), KVB_ERR_INVALID_ARG);
    cr_assert_eq(device, 7);
}

/* Without a driver no address can be device memory: the answer is "host", never an error. */
Test(cuda_missing, every_address_is_host)
{
    static char data[64];
    char *heap = malloc(64);
    const uint64_t addrs[] = {(uintptr_t)data, (uintptr_t)heap, 0, UINT64_MAX};
    for (size_t i = 0; i < sizeof addrs / sizeof addrs[0]; i++) {
        bool is_device = true;
        int device = 5;
        cr_assert_eq(kvb__cuda_pointer(addrs[i], &is_device, &device), KVB_OK);
        cr_assert_not(is_device);
        cr_assert_eq(device, -1);
    }
    free(heap);
}

Test(cuda_missing, error_text_without_driver)
{
    cr_assert_str_eq(kvb__cuda_errstr(KVB_CUDA_ERROR_INVALID_VALUE),
                     "CUDA_ERROR_INVALID_VALUE (1)");
    cr_assert_str_eq(kvb__cuda_errstr(KVB_CUDA_ERROR_NO_DEVICE), "CUDA_ERROR_NO_DEVICE (100)");
    cr_assert_str_eq(kvb__cuda_errstr(123456), "CUDA error 123456");
    cr_assert_eq(kvb__cuda_status(KVB_CUDA_SUCCESS, "nothing"), KVB_OK);
    cr_assert_eq(kvb__cuda_status(KVB_CUDA_ERROR_OUT_OF_MEMORY, "cuMemAlloc"), KVB_ERR_DEVICE);
}

static void *first_use(void *arg)
{
    *(bool *)arg = kvb__cuda_available();
    return (void *)kvb__cuda_reason();
}

/* The first use races from several threads: the library loads once and all see one answer. */
Test(cuda_missing, concurrent_first_use)
{
    enum { N = 8 };
    pthread_t threads[N];
    bool answers[N];
    for (int i = 0; i < N; i++)
        cr_assert_eq(pthread_create(&threads[i], NULL, first_use, &answers[i]), 0);
    for (int i = 0; i < N; i++) {
        void *why = NULL;
        cr_assert_eq(pthread_join(threads[i], &why), 0);
        cr_assert_not(answers[i]);
        cr_assert_eq(why, (void *)kvb__cuda_reason());
    }
    cr_assert(strstr(kvb__cuda_reason(), MISSING));
}

/* libm loads fine but exports no driver entry point: the first one looked up is named. */
Test(cuda_not_driver, missing_symbol_named)
{
    cr_assert_not(kvb__cuda_available());
    const char *why = kvb__cuda_reason();
    cr_assert(strstr(why, "libm.so.6"), "reason names the library: %s", why);
    cr_assert(strstr(why, "cuInit"), "reason names the missing symbol: %s", why);
    cr_assert_null(kvb__cuda());
    cr_assert_eq(kvb__cuda_device_count(), 0);
    cr_assert_eq(kvb__cuda_use(0), KVB_ERR_UNSUPPORTED);
    bool is_device = true;
    int device = 0;
    cr_assert_eq(kvb__cuda_pointer((uintptr_t)&device, &is_device, &device), KVB_OK);
    cr_assert_not(is_device);
    /* The library was unloaded: error text must not call into it. */
    cr_assert_str_eq(kvb__cuda_errstr(KVB_CUDA_ERROR_INVALID_VALUE),
                     "CUDA_ERROR_INVALID_VALUE (1)");
}

/* The real default path, on whatever machine runs the tests: the answers agree with each other
 * whether or not a driver and a GPU are there. */
Test(cuda_default, consistent_answers)
{
    bool is_device = true;
    int device = 0;
    int local = 0;
    cr_assert_eq(kvb__cuda_pointer((uintptr_t)&local, &is_device, &device), KVB_OK);
    cr_assert_not(is_device, "a stack address is host memory");
    if (kvb__cuda_available()) {
        cr_assert_str_eq(kvb__cuda_reason(), "");
        cr_assert_not_null(kvb__cuda());
        cr_assert_gt(kvb__cuda_device_count(), 0);
        cr_assert_eq(kvb__cuda_use(kvb__cuda_device_count()), KVB_ERR_INVALID_ARG);
    } else {
        cr_assert_neq(kvb__cuda_reason()[0], '\0');
        cr_assert_null(kvb__cuda());
        cr_assert_eq(kvb__cuda_device_count(), 0);
    }
}
